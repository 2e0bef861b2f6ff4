"""`andrea-export build` as a Python function, orchestration only: checkpoint -> ONNX -> plugin graph -> engine ->
Polygraphy verification -> a self-describing build folder with manifest.json.

The folder is locked for the whole build, assembled in a hidden staging folder beside `out`, and swapped
with `out` in one step (folder.atomic.update_folder) when every step has run, so a folder with a manifest
is a finished build (its `status` says whether it passed). Ctrl-C, a crash, kill -9 or a full disk
leave `out` as it was; `verify BUILD` updates the folder the same way.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import json
import platform
import shutil
import time
import tomllib
from pathlib import Path

from . import __version__
from .catalog import ENGINES, SIDECARS, TABLE, Artifacts, Role, decoder_graph, engine_source, plugin_source, weights_role
from .config import PRESETS, load_config
from .errors import AndreaExportError, BuildError, ConfigError
from .folder.atomic import locked_folder, sha256_file, update_folder, write_text_atomic
from .folder.reader import MANIFEST, SCHEMA_VERSION, changed_artifacts, read_engine_info, read_manifest
from .names import INPUT_IDS, MAX_SEED, MAX_SLOTS
from .progress import console, step, styled, warn
from .userfiles import MAX_CONFIG_BYTES, read_text

# the options whose files the folder keeps a copy of, by the table's fixed names (a manifest never picks a path)
COPIED = {"tokenizer": Role.TOKENIZER, "eval_text": Role.EVAL_TEXT}
MAX_WORKSPACE_MB = 1 << 20  # 1 TiB: more than any GPU has, and what TensorRT's size_t takes without overflow
PATH_OPTIONS = ("config", "checkpoint", "tokenizer", "eval_text", "timing_cache", "out")  # files a build reads or writes


@dataclasses.dataclass
class BuildOptions:
    """Every option of a build; a TOML file with these keys reproduces it (`--build-config`)."""

    config: str | None = None  # preset name or JSON file; default: from the checkpoint, else andrea-120m
    checkpoint: str | None = None  # None: seeded random weights (announced)
    seed: int = 0
    precision: str = "fp32"  # fp32 | fp16 | bf16 | int8 | int4: the precision of the ONNX graph the engine is built from
    builder: str = "auto"  # auto | tensorrt | tensorrt-rtx
    profiles: str | None = None  # "batch=1:1:8,seq=1:128:1024" (';' between profiles); default from the model
    opt_level: int = 3
    workspace_mb: int | None = None
    compute_capabilities: list[str] | None = None  # TensorRT-RTX targets, e.g. ["8.6", "12.0"]
    timing_cache: str | None = None  # default: <out>/timing.cache, reused by later builds into the same folder
    fuse_bias: bool = False  # plugin graph: fold the MLP bias Add into the plugin (TanhGeluBias)
    decoder: bool = True  # also the KV-cache decoder graph and its engine (prefill + decode profiles)
    max_slots: int = 0  # > 0: also the in-flight batching engine, for up to this many decoding rows (TensorRT >= 10.15)
    strip_weights: bool = False  # TensorRT (GPU host) only: weight-stripped engines, refitted from the ONNX at load
    verify_shapes: list[list[int]] | None = None  # [[batch, seq], ...]; default: verify.default_shapes
    greedy_steps: int = 32
    tokenizer: str | None = None  # a tokenizer.json: copied into the folder (generate --prompt uses it)
    eval_text: str | None = None  # a UTF-8 text file (needs tokenizer): perplexity of every artifact in verify.json
    out: str | None = None  # default: out/<model>-<precision>

    @classmethod
    def from_toml(cls, path: str | Path, **overrides) -> "BuildOptions":
        """The options of a TOML file (a build folder's build-config.toml, or one a user wrote), `overrides`
        (the command line's, None for not given) winning. A TOML may be shared, so every path it gives
        (PATH_OPTIONS) is taken relative to its folder and must stay inside it: a file elsewhere, to read
        or to write, has to be given on the command line."""
        path = Path(path)
        try:
            data = tomllib.loads(read_text(path, MAX_CONFIG_BYTES, "a build config", ConfigError))
        except (tomllib.TOMLDecodeError, RecursionError) as e:  # RecursionError: arrays nested thousands deep
            raise ConfigError(f"{path}: cannot read the build config: {str(e) or 'nested too deep'}") from None
        known = {f.name for f in dataclasses.fields(cls)}
        data = {k.replace("-", "_"): v for k, v in data.items()}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{path}: unknown build option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        for key in PATH_OPTIONS:
            if key in data and overrides.get(key) is None and isinstance(data[key], str):
                if not (key == "config" and data[key] in PRESETS):
                    data[key] = _toml_path_inside(path, key, data[key])
        data.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls(**data).check()
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    def check(self) -> "BuildOptions":
        """Check every option's type and range (nothing is loaded or built); returns self. Raises
        ConfigError naming the option. What depends on the model (profiles and verify shapes against its
        context) is checked by run_build as soon as the model config is known, still before any work."""
        from .engine.builder import OPT_LEVELS
        from .engine.compat import normalize_compute_capabilities
        from .engine.profiles import parse_profiles
        from .names import BUILDERS, PRECISIONS

        def bad(field: str, want: str):
            raise ConfigError(f"build option '{field}': expected {want}, got {getattr(self, field)!r}")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        for f in ("config", "checkpoint", "profiles", "timing_cache", "tokenizer", "eval_text", "out"):
            if getattr(self, f) is not None and not isinstance(getattr(self, f), str):
                bad(f, "a string")
        for f in ("fuse_bias", "decoder", "strip_weights"):
            if not isinstance(getattr(self, f), bool):
                bad(f, "true or false")
        if not is_int(self.seed) or not 0 <= self.seed <= MAX_SEED:
            bad("seed", "an integer in 0..2**63-1")
        if self.precision not in PRECISIONS:
            bad("precision", f"one of {', '.join(PRECISIONS)}")
        if self.builder not in ("auto", *BUILDERS):
            bad("builder", f"one of auto, {', '.join(BUILDERS)}")
        if not is_int(self.opt_level) or self.opt_level not in OPT_LEVELS:
            bad("opt_level", "an integer from 0 to 5")
        if self.workspace_mb is not None and (not is_int(self.workspace_mb) or not 1 <= self.workspace_mb <= MAX_WORKSPACE_MB):
            bad("workspace_mb", f"a positive integer (MiB), at most {MAX_WORKSPACE_MB:,}")
        if not is_int(self.max_slots) or not 0 <= self.max_slots <= MAX_SLOTS:
            bad("max_slots", f"an integer in 0..{MAX_SLOTS} (0: no slot engine)")
        if self.max_slots and not self.decoder:
            raise ConfigError("--max-slots builds the decoder's in-flight batching engine: it needs the decoder "
                              "(drop --no-decoder)")
        if not is_int(self.greedy_steps) or self.greedy_steps < 0:
            bad("greedy_steps", "an integer >= 0")
        if self.verify_shapes is not None and not (
                isinstance(self.verify_shapes, list) and self.verify_shapes
                and all(isinstance(s, list) and len(s) == 2 and all(is_int(v) and v >= 1 for v in s)
                        for s in self.verify_shapes)):
            bad("verify_shapes", "a list of [batch, seq] pairs of integers >= 1")
        if self.compute_capabilities is not None:
            if not isinstance(self.compute_capabilities, list) or not all(
                    isinstance(c, str) for c in self.compute_capabilities):
                bad("compute_capabilities", 'a list of strings such as ["8.6", "12.0"]')
            if self.builder == "tensorrt" and self.compute_capabilities:
                raise ConfigError("compute capabilities apply to TensorRT-RTX only: TensorRT builds for the GPU it runs on")
            normalize_compute_capabilities(self.compute_capabilities)
        if self.profiles is not None:
            parse_profiles(self.profiles)  # the syntax; the bounds need the model
        if self.eval_text and not self.tokenizer:
            raise ConfigError("--eval-text needs --tokenizer (the text is scored as that tokenizer's tokens)")
        return self

    def to_toml(self, folder: str | Path | None = None) -> str:
        """The effective options as TOML (None values are left out: they mean 'the default'). For the build
        folder `folder` itself: its paths relative to it, and the tokenizer and evaluation text as the
        copies it holds, so that the file repeats the build wherever the folder is moved."""
        values = dataclasses.asdict(self)
        if folder is not None:
            base = Path(folder).resolve()
            values.update({"out": "."} | {k: TABLE[r].file_name(self.precision) for k, r in COPIED.items() if values[k] is not None})
            for k in ("checkpoint", "config", "timing_cache"):
                if values[k] is not None and not (k == "config" and values[k] in PRESETS):
                    target = Path(values[k]).resolve()
                    values[k] = str(target.relative_to(base)) if base in target.parents else str(target)
        lines = ["# andrea-export build options: `andrea-export build --build-config THIS_FILE` repeats the build",
                 "# (paths are relative to this file's folder; one outside it must be given on the command line)"]
        for k, v in values.items():
            if v is not None:
                lines.append(f"{k} = {json.dumps(v)}")  # JSON scalars and lists are valid TOML
        return "\n".join(lines) + "\n"


def _toml_path_inside(toml: Path, key: str, value: str) -> str:
    """A path read from a TOML file, relative to the TOML's folder, which it must not leave (a
    build-config.toml sits in the build it repeats); returned resolved."""
    base = toml.resolve().parent
    if not value or "\x00" in value:
        raise ConfigError(f"{toml}: '{key}' must be a path, got {value!r:.60}")
    target = (base / value).resolve()
    if target != base and base not in target.parents:
        raise ConfigError(f"{toml}: '{key}' = {value!r} is outside the folder of this file ({base}); a build "
                          f"config may only name files in its own folder: give --{key.replace('_', '-')} "
                          "on the command line instead")
    return str(target)


def run_build(opts: BuildOptions, force: bool = False) -> dict:
    """Run the whole build; returns the manifest (also written to <out>/manifest.json).

    Raises AndreaExportError for bad input before any heavy step; a verification failure is not an
    exception: the manifest's status says "failed" (and the CLI exits 1)."""
    from .engine.backends import resolve_builder
    from .engine.compat import check_targets

    opts = opts.check()  # every option, before anything is loaded or built
    cfg = load_config(opts.config) if opts.config else None
    if cfg is not None:
        check_build_memory(cfg)  # before the weights are allocated
    checked = _check_for_model(opts, cfg) if cfg is not None else None  # before the model is loaded
    builder = resolve_builder(opts.builder)  # says what to install when there is no builder at all
    check_targets(builder, opts.compute_capabilities, opts.precision)
    _check_engine_gate_dependencies()
    if opts.max_slots:
        _check_slot_engine_builder(builder)
    if opts.strip_weights and builder == "tensorrt-rtx":
        from .engine.refit import STRIP_REFUSED_RTX

        raise ConfigError(STRIP_REFUSED_RTX)
    model = _load_model(opts, cfg)
    check_build_memory(model.cfg)  # a checkpoint's config is known once it is read
    profiles, evaluation = checked if checked is not None and model.cfg == cfg else _check_for_model(opts, model.cfg)
    cfg = model.cfg
    out = Path(opts.out or f"out/{cfg.name}-{opts.precision}")
    opts = dataclasses.replace(opts, out=str(out))
    # TensorRT reuses tactic timings across builds; TensorRT-RTX has no autotuning, so no cache by default.
    timing_cache = Path(opts.timing_cache) if opts.timing_cache else (out / "timing.cache" if builder == "tensorrt" else None)

    t0 = time.perf_counter()
    try:
        with locked_folder(out, create=True):  # a second run into `out` is refused until this one ends
            previous = _claim(out, opts, force)
            # the new build is staged beside `out` and swapped in whole; a replaced build's files
            # (named by its manifest) are not carried over, anything else in the folder is
            with update_folder(out, drop=previous) as tmp:
                manifest = _build_into(tmp, out, opts, model, builder, profiles, timing_cache, evaluation)
                write_text_atomic(tmp / "build-config.toml", opts.to_toml(out))
                manifest["build_seconds"] = round(time.perf_counter() - t0, 1)
                manifest["artifacts"] = _hash_artifacts(tmp, manifest["artifacts"])
                write_text_atomic(tmp / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise BuildError(f"no space left on the device while writing the build into {out}; nothing was left "
                             "behind: free some space (an fp32 ANDREA-120M build takes about 1.5 GB, twice that "
                             "while it is staged) and run it again") from None
        raise
    return manifest


# A build's peak memory is the libraries plus a multiple of the weights, held at once by PyTorch, the exported
# graphs, the verification's runners and the engine builder: fitted, with a margin, to the peaks measured in
# benchmarks/README.md ("A build's peak memory"); tests/test_careless_inputs.py keeps the fit to them.
BUILD_BASE_BYTES = 900 << 20
BUILD_BYTES_PER_PARAM = 60


def build_memory(cfg) -> int:
    """The bytes a build of `cfg` takes at its peak (an estimate from measured builds)."""
    return BUILD_BASE_BYTES + BUILD_BYTES_PER_PARAM * cfg.n_params


def check_build_memory(cfg, available: int | None = None) -> None:
    """ConfigError when the build of `cfg` would take more memory than this machine has free (`available`;
    default: errors.available_memory()): said before any of it is allocated."""
    from .errors import check_memory

    check_memory(cfg, build_memory(cfg), "building", available)


def _check_slot_engine_builder(builder: str) -> None:
    """--max-slots with a TensorRT older than the slot decoder's ops need (TensorScatter: 10.15) is refused now,
    not after minutes of exporting; the batch-1 decoder engine still builds there without it."""
    if builder != "tensorrt":  # TensorRT-RTX parses and builds the slot decoder (tests/engine/test_slot_engine.py)
        return
    from .engine.backends import trt_module
    from .engine.onnx_rules import SINCE, parse_version

    version = str(getattr(trt_module(builder), "__version__", "?"))
    need = SINCE["TensorScatter"]
    if parse_version(version) < need:
        raise ConfigError(f"--max-slots builds the in-flight batching engine, whose KV-cache updates (TensorScatter) "
                          f"TensorRT imports from {need[0]}.{need[1]} on; this is TensorRT {version}: install "
                          f"tensorrt>={need[0]}.{need[1]}, or build without --max-slots (the batch-1 decoder engine "
                          "builds with this one)")


def _check_engine_gate_dependencies() -> None:
    """Where a GPU can run the engines, the build checks them through the runtime's TensorRT session: what that
    needs is asked for now, not after minutes of building (the staged build would then be thrown away)."""
    from .errors import gpu_compute_capability

    if gpu_compute_capability() is not None:
        from .runtime.trt import cuda_runtime

        cuda_runtime()


def _check_for_model(opts: BuildOptions, cfg) -> tuple[list, tuple | None]:
    """The options that depend on the model, against its config: the optimization profiles and the
    evaluation text's (windows, description) or None (returned), the verification shapes and greedy steps."""
    from .engine.profiles import Profile, parse_profiles
    from .graphs.quantize import check_model_shape
    from .verify.inputs import check_inputs

    base = Profile.for_model(cfg)
    profiles = parse_profiles(opts.profiles, base) if opts.profiles else [base]
    for p in profiles:
        p.check(cfg.n_positions).check_tensor_sizes(cfg)
    check_inputs(cfg, opts.verify_shapes, opts.greedy_steps)
    evaluation = _check_text_options(opts, cfg)
    check_model_shape(cfg, opts.precision)
    return profiles, evaluation


def _check_text_options(opts: BuildOptions, cfg) -> tuple | None:
    """Refuse a bad tokenizer or evaluation text before anything heavy runs; returns the evaluation
    text's (windows, description), tokenized once for the whole build, or None without one."""
    from .model.text import load_tokenizer
    from .verify.folder import evaluation_windows

    if opts.tokenizer:
        tok = load_tokenizer(opts.tokenizer)
        if tok.get_vocab_size() > cfg.vocab_size:
            raise ConfigError(f"{opts.tokenizer}: {tok.get_vocab_size()} tokens, more than the model's vocabulary "
                              f"({cfg.vocab_size}); it is not this model's tokenizer")
        if opts.eval_text:
            return evaluation_windows(tok, opts.eval_text, cfg)  # refuses a text shorter than one window
    return None


def _load_model(opts: BuildOptions, cfg):
    from .model.checkpoint import load_model

    return load_model(opts.checkpoint, cfg, seed=opts.seed)


def _claim(out: Path, opts: BuildOptions, force: bool) -> set[str]:
    """Refuse to write into a folder that holds another build (a different set of options). Returns the
    files of the build it replaces, which go when the new one is in. Its manifest is untrusted: one that
    does not validate (or names files outside the folder) is refused, --force or not."""
    manifest = out / MANIFEST
    if not manifest.is_file():
        if out.is_dir() and any(p for p in out.iterdir() if not p.name.startswith(".") and p.name != "timing.cache"):
            if not force:
                raise BuildError(f"{out} is not empty and holds no andrea-export build; choose another --out or pass --force")
        return set()
    try:
        previous = read_manifest(out)
    except AndreaExportError as e:
        raise BuildError(f"{e}; the build in {out} cannot be replaced safely: remove the folder or choose another "
                         "--out") from None
    if previous["options"] != dataclasses.asdict(opts) and not force:
        raise BuildError(f"{out} holds another build (see {manifest}); choose another --out, or pass --force to replace it")
    return {a["path"] for a in previous["artifacts"].values()}


def _build_into(tmp: Path, out: Path, opts, model, builder: str, profiles, timing_cache: Path | None, evaluation) -> dict:
    """Every stage into the staging folder `tmp`, in order; returns the manifest (artifacts by role -> name)."""
    from .graphs.kvcache import optimization_profiles
    from .verify.folder import verify_folder

    made = Artifacts(tmp, opts.precision)
    plugin_report, int4 = _export_graphs(made, model, opts, builder)
    if opts.decoder:
        _export_decoders(made, model, opts, builder, int4)
    _share_weights(made)
    _copy_text_files(made, opts, model.cfg)
    result = _build_engine(made, Role.ENGINE, opts, builder, profiles, timing_cache)
    if opts.decoder:  # two optimization profiles: prefill (no past) and decode (one token)
        _build_engine(made, Role.DECODER_ENGINE, opts, builder, optimization_profiles(model.cfg), timing_cache)
    if opts.max_slots:  # decode rows, and a prompt's chunk beside them (graphs/slot_decoder.py)
        from .graphs.layout import read_kv_layout
        from .graphs.slot_decoder import slot_profiles
        from .names import PREFILL_CHUNK

        chunk = min(PREFILL_CHUNK, model.cfg.n_positions)
        _build_engine(made, Role.SLOT_ENGINE, opts, builder,
                      slot_profiles(read_kv_layout(made.path(Role.DECODER_ONNX_SLOTS)), opts.max_slots, chunk), timing_cache)
    report = verify_folder(tmp, model, opts.precision, made, result.to_dict(), opts.verify_shapes,
                           opts.greedy_steps, evaluation)
    made.add(Role.VERIFY_REPORT, report.save(tmp / TABLE[Role.VERIFY_REPORT].file_name(opts.precision)))
    return _manifest(opts, model, builder, profiles, made, result, plugin_report, report, int4)


def _manifest(opts, model, builder: str, profiles, made: Artifacts, result, plugin_report, report, int4=None) -> dict:
    from .names import WEIGHT_ONLY
    from .verify.folder import build_status, verification_record

    cfg = model.cfg
    source = made.path(engine_source(Role.ENGINE, builder, opts.precision))
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": {"name": "andrea-export", "version": __version__},
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "status": build_status(report),
        "model": cfg.to_dict(),
        "weights": model.weights_source,
        "precision": opts.precision,
        **({"quantization": _quantization(int4)} if opts.precision in WEIGHT_ONLY else {}),
        "builder": {"name": result.builder, "version": result.builder_version,
                    "compute_capabilities": result.compute_capabilities,
                    "compute_capabilities_default": result.compute_capabilities_default,
                    "opt_level": result.opt_level, "tf32": result.tf32, "workspace_mb": result.workspace_mb,
                    "build_seconds": result.build_seconds, "plugin_layers": result.plugin_layers,
                    "weights_stripped": result.weights_stripped,
                    "source_graph": source.name, "warnings": result.warnings},
        "profiles": [_profile_shapes(p) for p in profiles],
        "plugin": _plugin_info(plugin_report, builder),
        "verification": verification_record(report),
        "environment": _environment(),
        "options": dataclasses.asdict(opts),
        "artifacts": {role.value: name for role, name in made.items()},
    }


def engine_sources(artifacts, builder: str, precision: str) -> dict[str, str]:
    """The graph file each engine of `artifacts` (role -> name) is built from (catalog.engine_source)."""
    return {engine.value: artifacts[engine_source(engine, builder, precision)] for engine in ENGINES
            if engine_source(engine, builder, precision) in artifacts}


def _export_graphs(made: Artifacts, model, opts, builder: str):
    """The standard graph (and its fp32 source, and the Q/DQ form of a weight-only build) and the plugin graph
    made from the engine's graph. Returns the plugin report, and an int4 build's weights and head width
    (quantize.Int4Weights; None otherwise), which its other graphs take too."""
    from .graphs.export import export_onnx
    from .graphs.gelu_plugin import apply_gelu_plugin
    from .graphs.precision import convert_precision
    from .graphs.quantize import choose_int4, write_qdq
    from .names import WEIGHT_ONLY

    p = opts.precision
    what = ("weights to ONNX Runtime's MatMulNBits (weight-only; the embedding lookup stays float32)" if p in WEIGHT_ONLY
            else f"graph to {p} (LayerNorm and softmax stay float32)")
    fp32 = _name(made, Role.ONNX_FP32 if p != "fp32" else Role.ONNX)
    export_onnx(model, fp32)
    int4 = None
    if p == "int4":
        with step("Solving the int4 weights (GPTQ: each layer's error weighed by its inputs on random ids), and "
                  "measuring the tied head's share of their error"):
            int4 = choose_int4(fp32)
        console.print(f"  the tied head alone makes {int4.head_share:.0%} of int4's error: it is quantized at "
                      f"{int4.head_bits} bits")
    if p != "fp32":
        made.add(Role.ONNX_FP32, fp32)
        with step(f"Converting the {what}"):
            made.add(Role.ONNX, convert_precision(fp32, _name(made, Role.ONNX), p, *_int4_args(int4)))
    else:
        made.add(Role.ONNX, fp32)
    if p in WEIGHT_ONLY:  # TensorRT imports no MatMulNBits: its graphs quantize the fp32 weights as DequantizeLinear
        made.add(Role.ONNX_QDQ, write_qdq(fp32, _name(made, Role.ONNX_QDQ), p, *_int4_args(int4)))
    with step("Handing every tanh-GELU to the plugin (graph pass)"):
        plugin_report = apply_gelu_plugin(made.path(plugin_source(Role.ONNX_PLUGIN, p)), _name(made, Role.ONNX_PLUGIN),
                                          fuse_bias=opts.fuse_bias)
    made.add(Role.ONNX_PLUGIN, _name(made, Role.ONNX_PLUGIN))
    console.print(f"  {plugin_report.summary()}")
    return plugin_report, int4


def _int4_args(int4) -> tuple:
    """(head_bits, solved) of an int4 build's Int4Weights for the graph converters; (None, None) for any other."""
    return (int4.head_bits, int4.solved) if int4 else (None, None)


def _quantization(int4) -> dict:
    """The manifest's record of how a weight-only build's weights were quantized."""
    return int4.record() if int4 else {"method": "round-to-nearest"}


def _export_decoders(made: Artifacts, model, opts, builder: str, int4=None) -> None:
    """The KV-cache decoder in the build's precision (and its fp32 source), the in-place decoder ONNX Runtime and
    onnxruntime-genai run, genai's config, and the decoder engine's Q/DQ and plugin graphs."""
    from .deploy.genai import write_genai_config
    from .graphs.gelu_plugin import apply_gelu_plugin
    from .graphs.kvcache import export_decoder_onnx
    from .graphs.precision import convert_precision
    from .graphs.quantize import write_qdq
    from .names import WEIGHT_ONLY

    p = opts.precision
    with step("Exporting the KV-cache decoder graph"):
        fp32 = export_decoder_onnx(model, _name(made, Role.DECODER_ONNX_FP32 if p != "fp32" else Role.DECODER_ONNX),
                                   quiet=True)
    if p != "fp32":
        made.add(Role.DECODER_ONNX_FP32, fp32)
        made.add(Role.DECODER_ONNX, convert_precision(fp32, _name(made, Role.DECODER_ONNX), p, *_int4_args(int4)))
    else:
        made.add(Role.DECODER_ONNX, fp32)
    if p != "bf16":  # ONNX Runtime's CPU provider, which runs this graph, has no bf16 kernels
        _export_inplace_decoder(made, model, int4)
    _export_slot_decoder(made, model, int4, two_groups=opts.max_slots > 0)
    made.add(Role.GENAI_CONFIG, write_genai_config(made.path(decoder_graph("onnxruntime", made))))
    if p in WEIGHT_ONLY:
        made.add(Role.DECODER_ONNX_QDQ, write_qdq(fp32, _name(made, Role.DECODER_ONNX_QDQ), p, *_int4_args(int4)))
    if builder == "tensorrt":  # RTX has no plugin layers: it builds the standard decoder graph
        apply_gelu_plugin(made.path(plugin_source(Role.DECODER_ONNX_PLUGIN, p)), _name(made, Role.DECODER_ONNX_PLUGIN),
                          fuse_bias=opts.fuse_bias)
        made.add(Role.DECODER_ONNX_PLUGIN, _name(made, Role.DECODER_ONNX_PLUGIN))


def _name(made: Artifacts, role: Role) -> Path:
    """Where `role` is to be written in the staging folder: the name the table gives it."""
    return made.folder / TABLE[role].file_name(made.precision)


def _export_inplace_decoder(made: Artifacts, model, int4=None) -> None:
    """The in-place decoder (graphs/inplace_decoder.py) in the build's precision. Its float32 source is not kept
    (the standard decoder's is, for the engines)."""
    from .graphs.inplace_decoder import export_inplace_decoder
    from .graphs.precision import convert_precision

    with step("Writing the in-place KV-cache decoder (GroupQueryAttention, for ONNX Runtime)"):
        fp32 = _name(made, Role.DECODER_ONNX_INPLACE).with_name(TABLE[Role.DECODER_ONNX_INPLACE].file_name("fp32"))
        graph = export_inplace_decoder(model, fp32, quiet=True)
        if made.precision != "fp32":
            graph = convert_precision(fp32, _name(made, Role.DECODER_ONNX_INPLACE), made.precision, *_int4_args(int4))
            fp32.unlink()
    made.add(Role.DECODER_ONNX_INPLACE, graph)


def _export_slot_decoder(made: Artifacts, model, int4=None, two_groups: bool = False) -> None:
    """The slot decoder (graphs/slot_decoder.py) in the build's precision: converted like the other float graphs,
    or, for int8/int4, in the Q/DQ form TensorRT imports (it has no MatMulNBits). Its float32 source is not kept.
    `two_groups`: also its two-group form (graphs/two_groups.py), the slot engine's graph."""
    from .graphs.precision import convert_precision
    from .graphs.quantize import write_qdq
    from .graphs.slot_decoder import export_slot_decoder
    from .names import WEIGHT_ONLY

    p = made.precision
    with step("Writing the slot decoder (TensorScatter and Attention, for in-flight batching on TensorRT)"):
        fp32 = _name(made, Role.DECODER_ONNX_SLOTS).with_name(TABLE[Role.DECODER_ONNX_SLOTS].file_name("fp32"))
        graph = export_slot_decoder(model, fp32, quiet=True)
        if p != "fp32":
            convert = write_qdq if p in WEIGHT_ONLY else convert_precision
            graph = convert(fp32, _name(made, Role.DECODER_ONNX_SLOTS), p, *_int4_args(int4))
            fp32.unlink()
    made.add(Role.DECODER_ONNX_SLOTS, graph)
    if two_groups:
        import onnx_ir as ir

        from .graphs.two_groups import two_group_decoder

        with step("Writing its two-group form, the slot engine's graph (decoding rows and a prompt's chunk in one run)"):
            ir.save(two_group_decoder(ir.load(graph)), _name(made, Role.SLOT_ENGINE_ONNX))
        made.add(Role.SLOT_ENGINE_ONNX, _name(made, Role.SLOT_ENGINE_ONNX))


def _share_weights(made: Artifacts) -> None:
    """One weights file per precision, shared by that precision's graphs (the fp32 sources of a lower-precision
    build are the other precision): a folder holds each weight once, not once per graph."""
    from .graphs.external_data import share_weights

    by_precision = made.graphs_by_precision()
    with step("Storing the weights once per precision, shared by the graphs"):
        for p in sorted(by_precision, key=lambda p: p != made.precision):
            role = weights_role(p, made.precision)
            shared = share_weights(by_precision[p], _name(made, role))
            made.add(role, shared.path)
            console.print(f"  {shared.summary()}")


def _copy_text_files(made: Artifacts, opts, cfg) -> None:
    """The tokenizer (`generate --prompt` encodes with it; genai and transformers load it) and the evaluation text
    (`verify BUILD` measures the perplexity on it again), as the folder's own copies."""
    if opts.tokenizer:
        from .model.text import write_tokenizer_files

        for role, name in zip((Role.TOKENIZER, Role.TOKENIZER_CONFIG),
                              write_tokenizer_files(opts.tokenizer, made.folder, cfg.n_positions)):
            made.add(role, name)
    if opts.eval_text:
        shutil.copyfile(opts.eval_text, _name(made, Role.EVAL_TEXT))
        made.add(Role.EVAL_TEXT, _name(made, Role.EVAL_TEXT))


def _build_engine(made: Artifacts, engine: Role, opts, builder: str, profiles, timing_cache):
    """One engine from the graph the table says it is built from, and its sidecars; returns the build result."""
    from .engine.builder import build_engine

    result = build_engine(made.path(engine_source(engine, builder, made.precision)), _name(made, engine),
                          builder=builder, profiles=profiles, opt_level=opts.opt_level, workspace_mb=opts.workspace_mb,
                          timing_cache=timing_cache, compute_capabilities=opts.compute_capabilities,
                          strip_weights=opts.strip_weights)
    made.add(engine, result.plan)
    for role, path in zip(SIDECARS[engine], (result.sidecar, result.layer_report)):
        if path is not None and Path(path).is_file():
            made.add(role, path)
    return result


def verify_build(folder: str | Path, checkpoint: str | Path | None = None, shapes=None, greedy_steps: int = 32) -> dict:
    """Verify a finished build folder again, here: on a GPU host this runs the engine too. Rewrites
    verify.json and the manifest's status; refuses a folder whose files changed since the build."""
    from .config import ModelConfig
    from .graphs.external_data import check_folder_weights
    from .model.checkpoint import model_for
    from .verify.inputs import check_inputs
    from .verify.folder import build_status, verification_record, verify_folder

    folder = Path(folder)
    with locked_folder(folder):  # no build may replace it meanwhile
        m = read_manifest(folder)
        altered = changed_artifacts(folder, m)
        if altered:
            raise BuildError(f"{folder}: {', '.join(altered)} changed since the build (sha256 differs); rebuild instead")
        check_folder_weights(folder, m)  # every graph points only into recorded, unchanged weights files
        cfg = ModelConfig.from_dict(m["model"], source=f"{folder / MANIFEST}")
        check_inputs(cfg, shapes, greedy_steps)
        model = model_for(m["weights"], cfg, checkpoint, what=str(folder), command=verify_command(m, folder))
        made = Artifacts.of_manifest(folder, m)
        needed = [Role.ONNX, Role.ONNX_PLUGIN, Role.ENGINE, Role.ENGINE_INFO] + (
            [Role.DECODER_ENGINE_INFO] if Role.DECODER_ENGINE in made else []) + (
            [Role.DECODER_ONNX_SLOTS, Role.SLOT_ENGINE_INFO] if Role.SLOT_ENGINE in made else [])
        if missing := [r for r in needed if r not in made]:
            raise BuildError(f"{folder / MANIFEST}: no {', '.join(repr(r.value) for r in missing)} artifact: not a build "
                             "this andrea-export can verify")
        engine_info = read_engine_info(made.path(Role.ENGINE_INFO))
        # the new verify.json and manifest are staged with the unchanged files and swapped in together:
        # a crash never leaves a report that the manifest does not record
        with update_folder(folder) as tmp:
            report = verify_folder(folder, model, m["precision"], made, engine_info, shapes, greedy_steps)
            name = TABLE[Role.VERIFY_REPORT].file_name(m["precision"])
            report.save(tmp / name)
            m["status"], m["verification"] = build_status(report), verification_record(report)
            m["artifacts"][Role.VERIFY_REPORT.value] = _hash_artifacts(tmp, {Role.VERIFY_REPORT: name})[Role.VERIFY_REPORT]
            m["verified_on"] = _environment()
            write_text_atomic(tmp / MANIFEST, json.dumps(m, indent=2) + "\n")
    return m


def _profile_shapes(p) -> dict:
    (bmin, smin), (bopt, sopt), (bmax, smax) = p.shapes()
    return {INPUT_IDS: {"min": [bmin, smin], "opt": [bopt, sopt], "max": [bmax, smax]}}


def _plugin_info(report, builder: str) -> dict:
    from .plugin import GELU_BIAS_OP, GELU_OP, PLUGIN_NAMESPACE, PLUGIN_VERSION

    info = {"id": f"{PLUGIN_NAMESPACE}::{GELU_BIAS_OP if report.fuse_bias else GELU_OP}", "version": PLUGIN_VERSION,
            "calls": report.replaced, "in_engine": builder == "tensorrt",
            "embedded": builder == "tensorrt"}  # AOT: the kernel's PTX is inside the engine; no library to load
    try:
        from .plugin.compile import PLUGIN_ARCH, compile_ptx
        from .plugin.register import plugin_kernel

        # TensorRT: the kernel register_plugins compiled, which the engine embeds; else the portable sm_80 PTX
        embedded = plugin_kernel() if builder == "tensorrt" else None
        info["kernel"] = (embedded or compile_ptx(PLUGIN_ARCH)).manifest()
    except AndreaExportError as e:  # NVRTC missing: the graph and the engine do not depend on it
        info["kernel"] = f"not compiled here: {e}"
    return info


def _environment() -> dict:
    import importlib.metadata as md

    versions = {}
    for dist in ("torch", "onnx", "onnxruntime", "polygraphy", "onnx-ir", "tensorrt", "tensorrt-rtx-cu13",
                 "nvidia-cuda-nvrtc"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    from .errors import gpu_compute_capability

    return {"python": platform.python_version(), "platform": platform.platform(), "machine": platform.machine(),
            "gpu_compute_capability": gpu_compute_capability(), "packages": versions}


def _hash_artifacts(folder: Path, artifacts) -> dict:
    return {str(role): {"path": name, "sha256": sha256_file(folder / name), "bytes": (folder / name).stat().st_size}
            for role, name in artifacts.items()}


def verify_command(manifest: dict, out: Path) -> str:
    """The command that verifies the build `out` again: with its checkpoint, when it was built from one (the
    path as the build was given it; a recorded path is shown, never opened, since a folder may come from anyone)."""
    import shlex

    command = f"andrea-export verify {shlex.quote(str(out))}"
    if (manifest.get("weights") or {}).get("kind") != "checkpoint":
        return command
    ckpt = (manifest.get("options") or {}).get("checkpoint")
    return command + f" --checkpoint {shlex.quote(ckpt) if isinstance(ckpt, str) else 'CHECKPOINT'}"


def print_build_summary(manifest: dict, out: Path) -> None:
    from rich.table import Table

    t = Table(title=f"Build {out}", show_header=True)
    t.add_column("artifact")
    t.add_column("file")
    t.add_column("size", justify="right")
    for role, a in manifest["artifacts"].items():
        t.add_row(role, a["path"], f"{a['bytes'] / 1e6:,.1f} MB")
    console.print(t)
    b = manifest["builder"]
    built = f", built in {b['build_seconds']:.0f} s" if "build_seconds" in b else ""
    console.print(f"engine: {b['name']} {b['version']}, {manifest['precision']}, targets "
                  f"{', '.join(b['compute_capabilities']) or 'this GPU'}{built}; "
                  f"plugin calls in the graph: {manifest['plugin'].get('calls', '?')}")
    if ppl := (manifest.get("verification") or {}).get("perplexity"):
        console.print("perplexity on the evaluation text: " + ", ".join(f"{k} {v:.4f}" for k, v in ppl.items()))
    if isinstance(manifest.get("build_seconds"), (int, float)):
        console.print(f"total: {manifest['build_seconds']:.0f} s")
    status = manifest["status"]
    if status == "passed":
        console.print(styled("PASSED", "bold green") + ": every artifact, the engine included, matches PyTorch")
    elif status == "engine-unverified":
        reasons: dict[str, list[str]] = {}
        for s in manifest["verification"]["skipped"]:
            reasons.setdefault(s["reason"], []).append(s["artifact"])
        warn("the ONNX graphs match PyTorch, but the engines could not run here: "
             + "; ".join(f"{', '.join(names)}: {reason}" for reason, names in reasons.items()))
        console.print(styled("ENGINE UNVERIFIED", "bold yellow") + f": run `{verify_command(manifest, out)}` on a GPU host "
                      "of the target kind")
    else:
        console.print(styled("FAILED", "bold red") + ": verification failed; see verify.json. The folder is kept for inspection, "
                      "and its manifest says failed.")

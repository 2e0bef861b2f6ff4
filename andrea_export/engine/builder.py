"""ONNX -> engine (.plan), with TensorRT (GPU host; the graph may call our tanh-GELU plugin) or
TensorRT-RTX (ahead of time on any CPU; standard graph). One code path: the two Python APIs mirror
each other, and the code branches only where they differ:

| | TensorRT | TensorRT-RTX |
|---|---|---|
| needs a GPU to build | yes (it times tactics) | no (AOT; kernels are finished by JIT on the target) |
| plugin calls (`andrea::TanhGelu`) | imported as PLUGIN_V3 layers (plugin registered first) | expanded to native layers (function body) |
| targets | the building GPU | the compute capabilities set in the config |
| timing cache | loaded, used, saved | a documented no-op (deprecated in RTX 1.2): not written |
| layer report | engine inspector (JSON) | engine inspector needs an RTX GPU; else the builder's own layer log |
| weight-stripped plan (`strip_weights`) | STRIP_PLAN + REFIT_IDENTICAL; refit from the ONNX at load | refused: its CPU builder fails with these flags |

Both are strongly typed: precision comes from the ONNX graph (see precision.py), never from flags. On
TensorRT 10.x that is opt-in, so every network is created with `network_flags(trt)`.

Beside `<name>.plan` a build writes `<name>.plan.json` (what built it, for what, from what: read back by
`check_engine_compat` before an engine is reused) and `<name>.layers.json` (the layer report).
Everything is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Sequence

import onnx

from ..folder.atomic import atomic_path, sha256_file, write_text_atomic
from ..folder.reader import inside, metadata_json, read_engine_info
from ..config import ModelConfig
from ..errors import BuildError, ConfigError, ExportError, MissingDependency, gpu_compute_capability, installed, require
from ..graphs.external_data import external_data_files
from ..names import CONFIG_KEY, INPUT_IDS, PRECISION_KEY
from ..progress import console, warn

BUILDERS = ("tensorrt", "tensorrt-rtx")
_MODULES = {"tensorrt": ("tensorrt", "tensorrt"), "tensorrt-rtx": ("tensorrt_rtx", "rtx")}  # module, pip extra
INPUT_NAME = INPUT_IDS
OPT_LEVELS = range(0, 6)  # builder_optimization_level: 0 (fastest build) .. 5 (most search); 3 is TensorRT's default
# TensorRT-RTX's own default targets, documented: "an engine built by TensorRT-RTX can be run on GPU
# devices with compute capability 8.0, 8.6, 8.9, 12.0, and later" (cpu-engines.html). We keep that
# default (it builds fastest: listing the same four explicitly doubles the AOT time for the same plan).
RTX_DEFAULT_CCS = ("8.0", "8.6", "8.9", "12.0")
RTX_CCS = ("7.5", "8.0", "8.6", "8.9", "12.0", "12.1")  # what tensorrt_rtx.ComputeCapability names
TENSOR_VOLUME_LIMIT = 2**31  # TensorRT: "the volume of the tensor must be less than 2^31 elements"


# --- which builder --------------------------------------------------------------------------------


def trt_module(builder: str):
    """The imported `tensorrt` or `tensorrt_rtx` module for `builder` ("tensorrt" / "tensorrt-rtx")."""
    if builder not in _MODULES:
        raise ConfigError(f"builder must be one of auto, {', '.join(BUILDERS)}; got {builder!r}")
    module, extra = _MODULES[builder]
    why = f"Building engines with {_NAMES[builder]}"
    mod = require(module, extra, why)
    if not hasattr(mod, "Builder"):  # tensorrt-stubs installs an empty `tensorrt` namespace package
        raise MissingDependency(
            f"{why} needs the Python module '{module}', which could not be imported (only a package without "
            f"the library is installed: {list(getattr(mod, '__path__', []))[:1]}). "
            f"Install it with: pip install 'andrea-export[{extra}]'"
        )
    return mod


_NAMES = {"tensorrt": "TensorRT", "tensorrt-rtx": "TensorRT-RTX"}


def network_flags(trt) -> int:
    """`create_network` flags for a strongly typed network. Opt-in on TensorRT 10.x, always on (and ignored)
    in 11 and TensorRT-RTX; the enum's value differs (1 on 10.x, 0 on 11), so it is taken from the enum."""
    return 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)


def resolve_builder(choice: str = "auto") -> str:
    """"tensorrt" or "tensorrt-rtx". auto: TensorRT when it imports and a GPU is present, else
    TensorRT-RTX (which builds on a CPU), else an error that says what to install."""
    if choice == "auto":
        if gpu_compute_capability() is not None and installed("tensorrt"):
            return "tensorrt"
        if installed("tensorrt_rtx"):
            return "tensorrt-rtx"
        raise MissingDependency(
            "no engine builder available: install TensorRT-RTX, which builds engines on any machine "
            "(pip install 'andrea-export[rtx]'), or, on a host with an NVIDIA GPU, TensorRT "
            "(pip install 'andrea-export[tensorrt]')"
        )
    trt_module(choice)  # raises ConfigError / MissingDependency
    if choice == "tensorrt" and gpu_compute_capability() is None:
        raise BuildError("TensorRT builds engines on a GPU and none was found; use --builder tensorrt-rtx to build on a CPU")
    return choice


# --- optimization profiles -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Profile:
    """min/opt/max of one dimension of input_ids."""

    min: int
    opt: int
    max: int

    def check(self, field: str) -> "Profile":
        vals = (self.min, self.opt, self.max)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in vals) or not 1 <= self.min <= self.opt <= self.max:
            raise ConfigError(
                f"profile '{field}': expected min:opt:max with 1 <= min <= opt <= max, got {self.min}:{self.opt}:{self.max}"
            )
        return self

    def __str__(self) -> str:
        return f"{self.min}:{self.opt}:{self.max}"


@dataclasses.dataclass(frozen=True)
class Profiles:
    """One TensorRT optimization profile for input_ids [batch, seq]."""

    batch: Profile = Profile(1, 1, 8)
    seq: Profile = Profile(1, 128, 1024)

    def check(self, context: int | None = None) -> "Profiles":
        """Validate; `context` is the model's maximum sequence length (n_positions)."""
        self.batch.check("batch")
        self.seq.check("seq")
        if context is not None and self.seq.max > context:
            raise ConfigError(f"profile 'seq': max {self.seq.max} exceeds the model's context of {context} tokens")
        return self

    def check_tensor_sizes(self, cfg: ModelConfig) -> "Profiles":
        """Refuse maxima whose largest tensor TensorRT cannot hold: "the volume of the tensor must be less
        than 2^31 elements" (ITensor). The largest are the logits [batch, seq, vocab] and the attention
        scores [batch, heads, seq, seq]."""
        b, t = self.batch.max, self.seq.max
        per_sequence = max(t * cfg.vocab_size, cfg.n_head * t * t)
        if b * per_sequence >= TENSOR_VOLUME_LIMIT:
            limit = (TENSOR_VOLUME_LIMIT - 1) // per_sequence
            raise ConfigError(
                f"profile 'batch': max {b} with seq max {t} makes a tensor of {b * per_sequence:,} elements "
                f"({'logits' if t * cfg.vocab_size >= cfg.n_head * t * t else 'attention scores'}), and TensorRT "
                f"allows fewer than 2^31 per tensor: use a batch max of at most {limit} for {cfg.name} at {t} tokens"
            )
        return self

    @classmethod
    def for_model(cls, cfg: ModelConfig, max_batch: int = 8) -> "Profiles":
        """Defaults for a model: batch 1:1:max_batch, seq 1:min(128, context):context."""
        return cls(Profile(1, 1, max_batch), Profile(1, min(128, cfg.n_positions), cfg.n_positions))

    @classmethod
    def parse(cls, text: str, base: "Profiles | None" = None) -> "Profiles":
        """"batch=1:4:16,seq=1:128:1024"; a dimension left out keeps `base`'s; "batch=4" means 4:4:4."""
        fields = dataclasses.asdict(base or cls())
        fields = {k: Profile(**v) for k, v in fields.items()}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep:
                raise ConfigError(f"profile '{text}': expected entries like batch=1:4:16,seq=1:128:1024")
            if key not in fields:
                raise ConfigError(f"profile: unknown dimension '{key}'; known: batch, seq")
            nums = value.strip().split(":")
            if len(nums) not in (1, 3) or not all(re.fullmatch(r"\d+", n) for n in nums):
                raise ConfigError(f"profile '{key}': '{value.strip()}' is not min:opt:max (or one size) of integers")
            ints = [int(n) for n in nums] * (3 if len(nums) == 1 else 1)
            fields[key] = Profile(*ints)
        return cls(**fields).check()

    def shapes(self) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        return (self.batch.min, self.seq.min), (self.batch.opt, self.seq.opt), (self.batch.max, self.seq.max)

    def to_dict(self) -> dict:
        return {"batch": str(self.batch), "seq": str(self.seq)}


def parse_profiles(text: str, base: Profiles | None = None) -> list[Profiles]:
    """Several optimization profiles, separated by ';': "batch=1,seq=1:1:1;batch=1:4:16,seq=1:128:1024"."""
    parts = [p for p in text.split(";") if p.strip()]
    if not parts:
        raise ConfigError("profile: empty; expected entries like batch=1:4:16,seq=1:128:1024")
    return [Profiles.parse(p, base) for p in parts]


# --- the build --------------------------------------------------------------------------------------


@dataclasses.dataclass
class BuildResult:
    builder: str  # "tensorrt" / "tensorrt-rtx"
    builder_version: str
    plan: Path
    plan_bytes: int
    plan_sha256: str
    build_seconds: float
    onnx: Path
    precision: str  # from the graph's metadata (precision.py); TensorRT 11/RTX are strongly typed
    profiles: list[dict]
    opt_level: int
    tf32: bool  # TF32 GEMMs allowed (cleared for fp32 graphs)
    workspace_mb: int | None
    compute_capabilities: list[str]  # the targets; for TensorRT the building GPU
    compute_capabilities_default: bool  # RTX: the builder's own default targets were used
    plugin_layers: int  # PLUGIN_V3 layers in the network (TensorRT with the plugin graph)
    layer_report: Path | None
    layer_report_source: str  # "engine inspector" / "builder log (engine inspector not available: ...)"
    timing_cache: Path | None
    warnings: list[str] = dataclasses.field(default_factory=list)
    weights_stripped: bool = False  # the plan holds no weights: refit from `onnx` at load (refit_stripped)

    def to_dict(self) -> dict:
        """As the sidecar records it: the plan and the layer report by file name, like `onnx` relative to the
        plan's folder (the build is staged and then moved, and the folder itself can move)."""
        d = dataclasses.asdict(self)
        d["plan"] = self.plan.name
        d["layer_report"] = self.layer_report and os.path.relpath(self.layer_report, self.plan.parent)
        return {k: str(v) if isinstance(v, Path) else v for k, v in d.items()}

    @property
    def sidecar(self) -> Path:
        return sidecar_path(self.plan)


def sidecar_path(plan: str | Path) -> Path:
    return Path(str(plan) + ".json")


def layer_report_path(plan: str | Path) -> Path:
    plan = Path(plan)
    return plan.with_name(plan.stem + ".layers.json")


def build_engine(
    onnx_path: str | Path,
    plan_path: str | Path,
    *,
    builder: str = "auto",
    profiles: Profiles | Sequence[Profiles | dict] | None = None,
    opt_level: int = 3,
    workspace_mb: int | None = None,
    timing_cache: str | Path | None = None,
    compute_capabilities: Sequence[str] | None = None,
    strip_weights: bool = False,
    progress: bool = True,
) -> BuildResult:
    """Build `plan_path` from `onnx_path` and write its sidecar and layer report. See the module doc.

    profiles: one or several optimization profiles; default `Profiles.for_model(config of the ONNX)`.
        A graph with more inputs than input_ids (the KV-cache decoder) takes profiles as dicts
        {"name", "shapes": {input: {"min", "opt", "max"}}}, as `kvcache.optimization_profiles` makes them.
    opt_level: builder optimization level 0..5. workspace_mb: workspace pool limit (default: TensorRT's).
    timing_cache: file loaded when present and saved after the build (TensorRT only).
    compute_capabilities: TensorRT-RTX targets such as ["8.6", "8.9", "12.0"]; default the builder's
        own (8.0, 8.6, 8.9, 12.0 and later). "7.5" (Turing) must be alone and needs an fp16 graph.
    strip_weights: TensorRT only: a weight-stripped plan (BuilderFlag STRIP_PLAN + REFIT_IDENTICAL) for
        shipping beside the ONNX weights; `refit_stripped` puts the weights back at load. TensorRT-RTX's
        ahead-of-time CPU builder fails with these flags (its compiler needs CUDA; checked with 1.7), so
        it is refused there.
    """
    onnx_path, plan_path = Path(onnx_path), Path(plan_path)
    builder = resolve_builder(builder)
    trt = trt_module(builder)
    rtx = builder == "tensorrt-rtx"
    name = _NAMES[builder]
    if strip_weights and rtx:
        raise ConfigError(STRIP_REFUSED_RTX)

    # Everything that can be checked without TensorRT is checked before it starts.
    graph = _read_graph(onnx_path)
    cfg = _graph_config(graph, onnx_path)
    if profiles is None:
        profiles = [Profiles.for_model(cfg)] if cfg else [Profiles()]
    elif isinstance(profiles, Profiles):
        profiles = [profiles]
    if not profiles:
        raise ConfigError("profile: at least one optimization profile is needed")
    for p in profiles:
        if isinstance(p, Profiles):
            p.check(cfg.n_positions if cfg else None)
            if cfg:
                p.check_tensor_sizes(cfg)
    _check_inputs(onnx_path, graph, profiles)
    if opt_level not in OPT_LEVELS:
        raise ConfigError(f"opt_level must be an integer from 0 to 5, got {opt_level!r}")
    if workspace_mb is not None and (not isinstance(workspace_mb, int) or workspace_mb < 1):
        raise ConfigError(f"workspace_mb must be a positive integer (MiB), got {workspace_mb!r}")
    ccs, ccs_default = _compute_capabilities(trt, builder, compute_capabilities)
    plugin_calls = _plugin_calls(graph)
    precision = {p.key: p.value for p in graph.metadata_props}.get(PRECISION_KEY, "fp32")
    _check_precision(name, precision, ccs)
    warnings: list[str] = []
    if rtx and timing_cache is not None:
        warnings.append(
            f"timing cache {timing_cache} not used: TensorRT-RTX has no autotuning and its timing-cache "
            "operations are no-ops (deprecated in TensorRT-RTX 1.2)"
        )
        timing_cache = None
    if rtx and plugin_calls:
        warnings.append(
            f"{len(plugin_calls)} plugin call(s) built as their ONNX function bodies: TensorRT-RTX has no plugin layers"
        )
    if plan_path.is_file() and sidecar_path(plan_path).is_file():
        try:
            check_engine_compat(plan_path, read_engine_info(sidecar_path(plan_path)))
        except BuildError as e:
            warnings.append(f"replacing {plan_path.name}: {e}")
    if not rtx and plugin_calls:
        register = require("andrea_export.plugin.register", "tensorrt", "Building the plugin graph")
        register.register_plugins()

    logger = _make_logger(trt)
    t0 = time.perf_counter()
    b = trt.Builder(logger)
    network = b.create_network(network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):  # from the file: external weights are found beside it
        errors = []
        for i in range(parser.num_errors):
            e = parser.get_error(i)
            where = f"node '{e.node_name()}' ({e.node_operator()})" if e.node_name() or e.node_operator() else "model"
            why = e.code().name.lower().replace("_", " ")
            desc = e.desc().strip()
            errors.append(f"{where}: {why}" + (f": {desc}" if desc and desc not in ("false", "true") else ""))
        raise BuildError(f"{name} could not parse {onnx_path.name}: " + "; ".join(errors or logger.errors))
    plugin_layers = sum(network.get_layer(i).type == trt.LayerType.PLUGIN_V3 for i in range(network.num_layers))
    if not rtx and plugin_calls and plugin_layers < len(plugin_calls):
        raise BuildError(
            f"{name} {trt.__version__} imported {len(plugin_calls) - plugin_layers} of {len(plugin_calls)} plugin call(s) "
            "as their ONNX function bodies, not as the plugin: it needs TensorRT >= 10.7 with the plugin registered"
        )

    config = b.create_builder_config()
    config.builder_optimization_level = opt_level
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED  # layer names + tactics for the report
    if precision == "fp32":  # an fp32 graph is the exact engine: no TF32 GEMMs (the flag defaults to on)
        config.clear_flag(trt.BuilderFlag.TF32)
    if workspace_mb is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_mb << 20)
    if strip_weights:  # the plan keeps no weight the ONNX can give back; refit with those same weights at load
        config.set_flag(trt.BuilderFlag.STRIP_PLAN)
        config.set_flag(trt.BuilderFlag.REFIT_IDENTICAL)
    for p in profiles:
        prof = b.create_optimization_profile()
        if isinstance(p, Profiles):
            prof.set_shape(INPUT_NAME, *p.shapes())
        else:  # {"name", "shapes": {input: {"min", "opt", "max"}}}: every input named (kvcache.optimization_profiles)
            for tensor, s in p["shapes"].items():
                prof.set_shape(tensor, s["min"], s["opt"], s["max"])
        config.add_optimization_profile(prof)
    if rtx and not ccs_default:
        config.num_compute_capabilities = len(ccs)
        for i, cc in enumerate(ccs):
            config.set_compute_capability(getattr(trt.ComputeCapability, "SM" + cc.replace(".", "")), i)
    cache = None
    if timing_cache is not None:
        cache, note = _load_timing_cache(trt, config, Path(timing_cache), builder)
        if note:
            warnings.append(note)
    monitor = _monitor(trt, progress and console.is_terminal, f"Building {plan_path.name} with {name}")
    config.progress_monitor = monitor
    with monitor:
        serialized = b.build_serialized_network(network, config)
    if monitor.interrupted:
        raise KeyboardInterrupt
    if serialized is None:
        raise BuildError(f"{name} failed to build {onnx_path.name}: " + "; ".join(logger.errors or ["no reason given"]))
    seconds = time.perf_counter() - t0

    report, source = _layer_report(trt, builder, serialized, logger)
    warnings += [w for w in logger.warnings if not _expected_warning(w)]
    written: list[Path] = []
    try:
        if cache is not None:
            _save_timing_cache(cache, Path(timing_cache), builder, trt.__version__)
        lr = None
        if report is not None:
            lr = write_text_atomic(layer_report_path(plan_path), json.dumps(report, indent=1))
            written.append(lr)
        with atomic_path(plan_path) as tmp:
            with open(tmp, "wb") as f:
                f.write(memoryview(serialized))
            digest = sha256_file(tmp)
            result = BuildResult(
                builder=builder, builder_version=trt.__version__, plan=plan_path, plan_bytes=tmp.stat().st_size,
                plan_sha256=digest, build_seconds=round(seconds, 3),
                onnx=Path(os.path.relpath(onnx_path, plan_path.parent)),  # relative: the folder can move
                precision=precision,
                profiles=[p.to_dict() if isinstance(p, Profiles) else p for p in profiles], opt_level=opt_level, workspace_mb=workspace_mb,
                tf32=bool(config.get_flag(trt.BuilderFlag.TF32)),
                compute_capabilities=list(ccs), compute_capabilities_default=ccs_default, plugin_layers=plugin_layers,
                layer_report=lr, layer_report_source=source, timing_cache=Path(timing_cache) if cache else None,
                warnings=warnings, weights_stripped=strip_weights,
            )
            written.append(write_text_atomic(result.sidecar, json.dumps(result.to_dict(), indent=1)))
    except BaseException:
        for p in written:
            p.unlink(missing_ok=True)
        raise
    for w in warnings:
        if progress:
            warn(w)
    return result


STRIP_REFUSED_RTX = (
    "weight-stripped engines (--strip-weights) need full TensorRT on a GPU host (--builder tensorrt): "
    "TensorRT-RTX's ahead-of-time CPU builder fails with BuilderFlag STRIP_PLAN or REFIT (its compiler needs "
    "CUDA: MyelinCheckException, checked with TensorRT-RTX 1.7); build without --strip-weights here"
)


def refit_stripped(trt, engine, plan_path: str | Path, info: dict, logger=None) -> bool:
    """Put the weights back into a weight-stripped `engine` (deserialized from `plan_path`, whose sidecar is
    `info`) from the ONNX it was built from, beside the plan; returns whether it had to. GPU hosts only.

    The sidecar is untrusted: its `onnx` must be a plain file name beside the plan, and that graph's
    weights files are checked (external_data_files) before TensorRT's parser reads them."""
    if not info.get("weights_stripped"):
        return False
    plan_path = Path(plan_path)
    graph = inside(plan_path.parent, info.get("onnx"), f"{plan_path}.json: 'onnx' (the graph to refit from)", flat=True)
    try:
        external_data_files(graph)
    except ExportError as e:
        raise BuildError(f"{plan_path}: cannot refit its weights: {e}") from None
    if info.get("plugin_layers"):
        require("andrea_export.plugin.register", "tensorrt", "Refitting a plugin engine").register_plugins()
    logger = logger or _make_logger(trt)
    refitter = trt.Refitter(engine, logger)
    parser = trt.OnnxParserRefitter(refitter, logger)
    if not parser.refit_from_file(str(graph)):
        errors = "; ".join(parser.get_error(i).desc() for i in range(parser.num_errors)) or "no reason given"
        raise BuildError(f"{plan_path}: refitting its weights from {graph.name} failed: {errors}")
    missing = refitter.get_missing_weights()
    if missing:
        raise BuildError(f"{plan_path}: {graph.name} does not give every weight the engine needs (missing: "
                         f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}): not the graph it was built from")
    if not refitter.refit_cuda_engine():
        raise BuildError(f"{plan_path}: TensorRT could not refit the engine from {graph.name} (see the log above)")
    return True


def _expected_warning(message: str) -> bool:
    """Parser warnings every build of our graphs gives, which tell the user nothing."""
    return (
        ("Make sure input " in message and "has Int64 binding" in message)  # our int64 inputs are by design
        # each expanded call of a model-local function (the plugin graph on RTX) reuses the body's node names
        or "already exists, the output tensors of this new instance will not be queryable" in message
    )


def check_engine_compat(plan_path: str | Path, manifest: dict) -> dict:
    """Check that the engine `plan_path`, described by `manifest` (its `.plan.json` sidecar or the
    package manifest's engine entry), can run here. Raises BuildError saying what differs and to rebuild.

    Checked: the file is the one recorded (size, sha256 when recorded); the builder is installed at the
    recorded version (engines are not portable across TensorRT versions); and, where a GPU is present,
    its compute capability is a recorded target, and the runtime's own header check (RTX
    `get_engine_validity`) agrees. Returns {"checked": [...], "skipped": [...]}."""
    plan_path = Path(plan_path)
    checked, skipped = [], []
    if not plan_path.is_file():
        raise BuildError(f"{plan_path}: no such engine file")
    for key in ("builder", "builder_version"):
        if key not in manifest:
            raise BuildError(f"{plan_path}: its manifest has no '{key}'; cannot tell what built it: rebuild it")
    size = plan_path.stat().st_size
    if "plan_bytes" in manifest and manifest["plan_bytes"] != size:
        raise BuildError(f"{plan_path}: {size} bytes, but its manifest records {manifest['plan_bytes']}: not the engine it describes")
    if "plan_sha256" in manifest:
        if sha256_file(plan_path) != manifest["plan_sha256"]:
            raise BuildError(f"{plan_path}: sha256 differs from its manifest: not the engine it describes")
        checked.append("sha256")
    builder, recorded = manifest["builder"], manifest["builder_version"]
    trt = trt_module(builder)
    if trt.__version__ != recorded:
        raise BuildError(
            f"{plan_path}: built with {_NAMES[builder]} {recorded}, but this environment has {trt.__version__}; "
            f"engines do not load across versions: rebuild it, or install {_MODULES[builder][0]}=={recorded}"
        )
    checked.append("builder version")
    cc = gpu_compute_capability()
    targets = list(manifest.get("compute_capabilities") or [])
    if cc is None:
        skipped.append("compute capability (no GPU here)")
    else:
        default = manifest.get("compute_capabilities_default", False)
        ok = cc in targets or (default and int(cc.split(".")[0]) >= 12)
        if not ok:
            raise BuildError(
                f"{plan_path}: built for compute capability {', '.join(targets) or '?'}, but this GPU is {cc}: rebuild it here"
                + (" (with --compute-capability " + cc + ")" if builder == "tensorrt-rtx" else "")
            )
        checked.append("compute capability")
        runtime = trt.Runtime(_make_logger(trt))
        if hasattr(runtime, "get_engine_validity") and hasattr(runtime, "engine_header_size"):
            with open(plan_path, "rb") as f:
                header = f.read(runtime.engine_header_size)
            validity, diagnostics = runtime.get_engine_validity(header)
            if validity != trt.EngineValidity.VALID:
                raise BuildError(f"{plan_path}: {_NAMES[builder]} says the engine is {validity.name} here (diagnostics {diagnostics}): rebuild it")
            checked.append("engine header")
    return {"checked": checked, "skipped": skipped}


# --- helpers ----------------------------------------------------------------------------------------


def graph_inputs(graph: onnx.ModelProto) -> list[str]:
    return [i.name for i in graph.graph.input if i.name not in {t.name for t in graph.graph.initializer}]


def _check_inputs(path: Path, graph: onnx.ModelProto, profiles) -> None:
    """Every graph input needs a shape range in every profile: input_ids alone for a Profiles, all for a dict."""
    inputs = graph_inputs(graph)
    for p in profiles:
        if isinstance(p, Profiles) and inputs != [INPUT_NAME]:
            raise BuildError(f"{path}: the graph's input(s) are {', '.join(repr(i) for i in inputs)}; "
                             f"expected one input '{INPUT_NAME}' (an andrea-export ONNX)")
        if isinstance(p, dict) and sorted(p["shapes"]) != sorted(inputs):
            raise BuildError(f"{path}: the graph's input(s) are {', '.join(repr(i) for i in inputs)}; optimization "
                             f"profile '{p.get('name', '?')}' gives shapes for {', '.join(repr(i) for i in p['shapes'])}")


def _read_graph(path: Path) -> onnx.ModelProto:
    if not path.is_file():
        raise BuildError(f"{path}: no such ONNX file")
    try:
        graph = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf's DecodeError has no public type
        raise BuildError(f"{path}: not an ONNX model ({type(e).__name__}: {e})") from None
    try:  # the parser reads the weights files itself, and follows a symlink out of the folder
        external_data_files(path, graph)
    except ExportError as e:
        raise BuildError(str(e)) from None
    if not graph_inputs(graph):
        raise BuildError(f"{path}: the graph has no inputs")
    return graph


def _graph_config(graph: onnx.ModelProto, path: Path) -> ModelConfig | None:
    meta = {p.key: p.value for p in graph.metadata_props}
    if CONFIG_KEY not in meta:
        return None  # not ours: no context limit known; TensorRT still checks what it can
    return ModelConfig.from_dict(metadata_json(meta, CONFIG_KEY, path), source=f"{path} metadata")


def _plugin_calls(graph: onnx.ModelProto) -> list[str]:
    from ..plugin import GELU_BIAS_OP, GELU_OP, PLUGIN_NAMESPACE

    return [n.name for n in graph.graph.node if n.domain == PLUGIN_NAMESPACE and n.op_type in (GELU_OP, GELU_BIAS_OP)]


def _compute_capabilities(trt, builder: str, requested: Sequence[str] | None) -> tuple[list[str], bool]:
    if builder == "tensorrt":
        if requested:
            raise ConfigError("compute capabilities apply to TensorRT-RTX only: TensorRT builds for the GPU it runs on")
        return [gpu_compute_capability() or "?"], False
    if not requested:
        return list(RTX_DEFAULT_CCS), True
    out = normalize_compute_capabilities(requested)
    for cc in out:
        if not hasattr(trt.ComputeCapability, "SM" + cc.replace(".", "")):
            raise ConfigError(f"compute capability {cc!r} is not a target of this TensorRT-RTX {trt.__version__}")
    return out, False


def normalize_compute_capabilities(requested: Sequence[str]) -> list[str]:
    """TensorRT-RTX targets as "8.6" (also accepted: "86", "sm_86"), checked without TensorRT-RTX."""
    out = []
    for cc in requested:
        norm = str(cc).strip().lower().removeprefix("sm_").removeprefix("sm")
        if re.fullmatch(r"\d{2,3}", norm):
            norm = f"{norm[:-1]}.{norm[-1]}"
        if norm not in RTX_CCS:
            raise ConfigError(f"compute capability {cc!r} is not a TensorRT-RTX target; choose from {', '.join(RTX_CCS)}")
        if norm not in out:
            out.append(norm)
    if "7.5" in out and len(out) > 1:
        raise ConfigError("compute capability 7.5 (Turing) must be built alone: TensorRT-RTX makes no portable engines with Turing")
    return out


def check_targets(builder: str, requested: Sequence[str] | None, precision: str) -> None:
    """The target GPUs against the builder and the precision, before anything is built."""
    if builder == "tensorrt":
        if requested:
            raise ConfigError("compute capabilities apply to TensorRT-RTX only: TensorRT builds for the GPU it runs on")
        return
    _check_precision(_NAMES[builder], precision, normalize_compute_capabilities(requested) if requested else [])


def _check_precision(name: str, precision: str, ccs: list[str]) -> None:
    """Refuse, before the builder starts, a precision the target GPUs cannot run (TensorRT would fail
    late and obscurely). Turing (7.5) has no bf16, and TensorRT-RTX builds no fp32 GEMMs for it."""
    old = [cc for cc in ccs if cc != "?" and tuple(map(int, cc.split("."))) < (8, 0)]
    if not old:
        return
    if precision == "bf16":
        raise ConfigError(f"precision bf16 needs compute capability 8.0 or newer; the target {', '.join(old)} has "
                          "no bf16: build fp16 (--precision fp16)")
    if precision in ("fp32", "int8", "int4") and name == "TensorRT-RTX":  # weight-only: float32 activations
        raise ConfigError("TensorRT-RTX builds no fp32 matrix multiplies for compute capability 7.5 (Turing): "
                          "build an fp16 graph (--precision fp16) for it")


def _make_logger(trt):
    """A TensorRT logger that collects warnings and errors for messages, and the builder's layer listing."""

    class Logger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.errors: list[str] = []
            self.warnings: list[str] = []
            self.layers_text: str | None = None
            self._lock = threading.Lock()

        def log(self, severity, msg):
            S = trt.ILogger.Severity
            with self._lock:
                if severity in (S.INTERNAL_ERROR, S.ERROR):
                    self.errors.append(msg.strip())
                elif severity == S.WARNING:
                    self.warnings.append(msg.strip())
                elif msg.startswith("Layers:\n"):
                    self.layers_text = msg

    return Logger()


def _monitor(trt, show: bool, title: str):
    """A TensorRT IProgressMonitor drawing rich progress bars, one per running build phase."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    class Monitor(trt.IProgressMonitor):
        def __init__(self):
            trt.IProgressMonitor.__init__(self)
            self.interrupted = False
            self._tasks: dict[str, tuple[int, int]] = {}  # phase -> (task id, depth)
            self._lock = threading.Lock()
            self._progress = (
                Progress(TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                         console=console, transient=True)
                if show else None
            )

        def __enter__(self):
            if self._progress:
                self._progress.start()
                console.print(title)
            return self

        def __exit__(self, *exc):
            if self._progress:
                self._progress.stop()

        def phase_start(self, phase_name, parent_phase, num_steps):
            try:
                with self._lock:
                    depth = self._tasks[parent_phase][1] + 1 if parent_phase in self._tasks else 0
                    tid = self._progress.add_task("  " * depth + phase_name, total=num_steps) if self._progress else -1
                    self._tasks[phase_name] = (tid, depth)
            except BaseException:  # Ctrl-C lands in whichever Python code runs: cancel the build
                self.interrupted = True

        def step_complete(self, phase_name, step):
            try:
                with self._lock:
                    if self._progress and phase_name in self._tasks:
                        self._progress.update(self._tasks[phase_name][0], completed=step + 1)
            except BaseException:
                self.interrupted = True
            return not self.interrupted  # False asks TensorRT to cancel the build

        def phase_finish(self, phase_name):
            try:
                with self._lock:
                    tid, _ = self._tasks.pop(phase_name, (None, 0))
                    if self._progress and tid is not None:
                        self._progress.remove_task(tid)
            except BaseException:
                self.interrupted = True

    return Monitor()


def _layer_report(trt, builder: str, serialized, logger) -> tuple[dict | None, str]:
    """The engine inspector's JSON where the engine deserializes here, else the builder's layer log."""
    reason = None
    if gpu_compute_capability() is None:
        reason = "no GPU here (an engine deserializes only on a GPU it targets)"
    else:
        try:
            engine = trt.Runtime(logger).deserialize_cuda_engine(serialized)
            if engine is None:
                reason = "the engine does not deserialize on this GPU"
            else:
                inspector = engine.create_engine_inspector()
                info = json.loads(inspector.get_engine_information(trt.LayerInformationFormat.JSON))
                return {"source": "engine inspector", "builder": builder, **info}, "engine inspector"
        except Exception as e:  # the inspector is a report, never a reason to fail a finished build
            reason = f"{type(e).__name__}: {e}"
    source = f"builder log (engine inspector not available: {reason})"
    if not logger.layers_text:
        return None, f"not available: {reason}; the builder logged no layer listing"
    layers = []
    for line in logger.layers_text.splitlines()[1:]:
        m = re.match(r"Name: (?P<name>.*?), LayerType: (?P<type>[^,]*),", line)
        if not m:
            continue
        tactic = re.search(r"TacticName: ([^,]*),", line)
        layers.append({
            "name": m["name"],
            "type": m["type"],
            "tactic": tactic.group(1).strip() if tactic else "",
            "onnx_nodes": re.findall(r"\[ONNX Layer: ([^\]]+)\]", line),
        })
    return {"source": source, "builder": builder, "layers": layers}, source


def _load_timing_cache(trt, config, path: Path, builder: str):
    """A timing cache for the config: from `path` when present and made by this TensorRT, else empty."""
    note = None
    data = b""
    if path.is_file():
        meta_path = sidecar_path(path)
        try:
            meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        except (OSError, UnicodeDecodeError, ValueError):
            meta = {"unreadable": str(meta_path)}  # then not this TensorRT's: a new cache
        here = {"builder": builder, "builder_version": trt.__version__, "gpu": gpu_compute_capability()}
        if meta and meta != here:
            note = f"timing cache {path} was made by {meta} and this is {here}: starting a new one"
        else:
            data = path.read_bytes()
    cache = config.create_timing_cache(data)
    if not config.set_timing_cache(cache, False):
        note = f"timing cache {path} was rejected by {_NAMES[builder]}: starting a new one"
        cache = config.create_timing_cache(b"")
        config.set_timing_cache(cache, False)
    return cache, note


def _save_timing_cache(cache, path: Path, builder: str, version: str) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(memoryview(cache.serialize()))
    meta = {"builder": builder, "builder_version": version, "gpu": gpu_compute_capability()}
    write_text_atomic(sidecar_path(path), json.dumps(meta, indent=1))

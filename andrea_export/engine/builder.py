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

Both are strongly typed: precision comes from the ONNX graph (see graphs/precision.py), never from flags. On
TensorRT 10.x that is opt-in, so every network is created with `network_flags(trt)`.

Beside `<name>.plan` a build writes `<name>.plan.json` (what built it, for what, from what: read back by
`check_engine_compat` before an engine is reused) and `<name>.layers.json` (the layer report).
Everything is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any, Sequence

import onnx
from onnx import ModelProto  # BuildJob's field `onnx` hides the module inside the class

from ..config import ModelConfig
from ..errors import BuildError, ConfigError, ExportError, gpu_compute_capability, require
from ..folder.atomic import atomic_path, sha256_file, write_text_atomic
from ..folder.reader import metadata_json, read_engine_info
from ..graphs.external_data import external_data_files
from ..names import CONFIG_KEY, INPUT_IDS, PRECISION_KEY
from ..progress import console, warn
from ..userfiles import MAX_JSON_BYTES, read_json
from .backends import BUILDER_NAMES, network_flags, resolve_builder, trt_module
from .compat import build_targets, check_engine_compat, check_precision
from .log import ctrl_c_cancels, expected_warning, layer_report, make_logger, progress_monitor
from .profiles import Profile
from .refit import STRIP_REFUSED_RTX, sidecar_path

INPUT_NAME = INPUT_IDS
OPT_LEVELS = range(0, 6)  # builder_optimization_level: 0 (fastest build) .. 5 (most search); 3 is TensorRT's default


@dataclasses.dataclass
class BuildResult:
    builder: str  # "tensorrt" / "tensorrt-rtx"
    builder_version: str
    plan: Path
    plan_bytes: int
    plan_sha256: str
    build_seconds: float
    onnx: Path
    precision: str  # from the graph's metadata (graphs/precision.py); TensorRT 11/RTX are strongly typed
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


def layer_report_path(plan: str | Path) -> Path:
    plan = Path(plan)
    return plan.with_name(plan.stem + ".layers.json")


def build_engine(
    onnx_path: str | Path,
    plan_path: str | Path,
    *,
    builder: str = "auto",
    profiles: Profile | Sequence[Profile | dict] | None = None,
    opt_level: int = 3,
    workspace_mb: int | None = None,
    timing_cache: str | Path | None = None,
    compute_capabilities: Sequence[str] | None = None,
    strip_weights: bool = False,
    progress: bool = True,
) -> BuildResult:
    """Build `plan_path` from `onnx_path` and write its sidecar and layer report. See the module doc.

    profiles: one or several optimization profiles; default `Profile.for_model(config of the ONNX)`.
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
    job = _plan_build(Path(onnx_path), Path(plan_path), builder, profiles, opt_level, workspace_mb,
                      timing_cache, compute_capabilities, strip_weights)  # fmt: skip
    trt = job.trt
    if not job.rtx and job.plugin_calls:
        register = require("andrea_export.plugin.register", "tensorrt", "Building the plugin graph")
        register.register_plugins()
    logger = make_logger(trt)
    t0 = time.perf_counter()
    b = trt.Builder(logger)
    network, parser = _parse(job, b, logger)  # the parser owns the weights the network points into
    plugin_layers = _plugin_layers(job, network)
    _allow_decomposed_attention(job, network)
    config = _builder_config(job, b)
    cache = None
    if job.timing_cache is not None:
        cache, note = _load_timing_cache(trt, config, job.timing_cache, job.builder)
        job.warnings += [note] if note else []
    serialized = _serialize(job, b, network, config, logger, progress)
    seconds = time.perf_counter() - t0
    del parser
    report, source = layer_report(trt, job.builder, serialized, logger)
    job.warnings += [w for w in logger.warnings if not expected_warning(w)]
    result = BuildResult(
        builder=job.builder, builder_version=trt.__version__, plan=job.plan, plan_bytes=0, plan_sha256="",
        build_seconds=round(seconds, 3), onnx=Path(os.path.relpath(job.onnx, job.plan.parent)),  # the folder can move
        precision=job.precision, profiles=[record for _, record in job.profiles], opt_level=opt_level,
        workspace_mb=workspace_mb, tf32=bool(config.get_flag(trt.BuilderFlag.TF32)),
        compute_capabilities=list(job.ccs), compute_capabilities_default=job.ccs_default, plugin_layers=plugin_layers,
        layer_report=None, layer_report_source=source, timing_cache=job.timing_cache if cache else None,
        warnings=job.warnings, weights_stripped=strip_weights,
    )  # fmt: skip
    _write_outputs(result, serialized, report, cache)
    for w in job.warnings:
        if progress:
            warn(w)
    return result


@dataclasses.dataclass
class _Job:
    """One build, checked before TensorRT starts: what every later step reads."""

    onnx: Path
    plan: Path
    builder: str
    trt: Any  # the tensorrt or tensorrt_rtx module
    graph: ModelProto
    profiles: list[tuple[dict, dict]]  # (shapes of every input, the profile as the sidecar records it)
    opt_level: int
    workspace_mb: int | None
    timing_cache: Path | None
    ccs: list[str]
    ccs_default: bool
    precision: str
    plugin_calls: list[str]
    strip_weights: bool
    warnings: list[str]

    @property
    def rtx(self) -> bool:
        return self.builder == "tensorrt-rtx"

    @property
    def name(self) -> str:
        return BUILDER_NAMES[self.builder]


def _plan_build(onnx_path: Path, plan_path: Path, builder: str, profiles, opt_level: int, workspace_mb: int | None,
                timing_cache: str | Path | None, compute_capabilities: Sequence[str] | None,
                strip_weights: bool) -> _Job:  # fmt: skip
    """Everything that can be checked without TensorRT, checked before it starts."""
    builder = resolve_builder(builder)
    trt = trt_module(builder)
    rtx = builder == "tensorrt-rtx"
    if strip_weights and rtx:
        raise ConfigError(STRIP_REFUSED_RTX)
    graph = _read_graph(onnx_path)
    cfg = _graph_config(graph, onnx_path)
    if not rtx:  # RTX's parser is laxer than TensorRT's: refuse here what TensorRT would refuse on the GPU host
        from .onnx_rules import check_tensorrt_import, check_tensorrt_version

        check_tensorrt_import(onnx_path)
        check_tensorrt_version(graph, trt.__version__, onnx_path)
    shapes = _profile_shapes(onnx_path, graph, cfg, profiles)
    if opt_level not in OPT_LEVELS:
        raise ConfigError(f"opt_level must be an integer from 0 to 5, got {opt_level!r}")
    if workspace_mb is not None and (not isinstance(workspace_mb, int) or workspace_mb < 1):
        raise ConfigError(f"workspace_mb must be a positive integer (MiB), got {workspace_mb!r}")
    ccs, ccs_default = build_targets(trt, builder, compute_capabilities)
    precision = {p.key: p.value for p in graph.metadata_props}.get(PRECISION_KEY, "fp32")
    check_precision(BUILDER_NAMES[builder], precision, ccs)
    job = _Job(onnx_path, plan_path, builder, trt, graph, shapes, opt_level, workspace_mb,
               Path(timing_cache) if timing_cache is not None else None, list(ccs), ccs_default, precision,
               _plugin_calls(graph), strip_weights, [])  # fmt: skip
    _warn_ahead(job)
    return job


def _profile_shapes(path: Path, graph: onnx.ModelProto, cfg: ModelConfig | None,
                    profiles: Profile | Sequence[Profile | dict] | None) -> list[tuple[dict, dict]]:  # fmt: skip
    """Each optimization profile as (shapes of every input, its sidecar record), checked against the model
    (context, TensorRT's tensor-volume limit) and against the graph's inputs, which each one must cover."""
    if profiles is None:
        profiles = [Profile.for_model(cfg) if cfg else Profile()]
    elif isinstance(profiles, Profile):
        profiles = [profiles]
    if not profiles:
        raise ConfigError("profile: at least one optimization profile is needed")
    inputs = graph_inputs(graph)
    out = []
    for p in profiles:
        if isinstance(p, Profile):
            p.check(cfg.n_positions if cfg else None)
            if cfg:
                p.check_tensor_sizes(cfg)
            if inputs != [INPUT_NAME]:
                raise BuildError(f"{path}: the graph's input(s) are {', '.join(repr(i) for i in inputs)}; "
                                 f"expected one input '{INPUT_NAME}' (an andrea-export ONNX)")  # fmt: skip
            out.append((p.input_shapes(), p.to_dict()))
        else:  # {"name", "shapes": {input: {"min", "opt", "max"}}}: every input named (kvcache.optimization_profiles)
            if sorted(p["shapes"]) != sorted(inputs):
                raise BuildError(f"{path}: the graph's input(s) are {', '.join(repr(i) for i in inputs)}; optimization "
                                 f"profile '{p.get('name', '?')}' gives shapes for {', '.join(repr(i) for i in p['shapes'])}")  # fmt: skip
            out.append((p["shapes"], p))
    return out


def _warn_ahead(job: _Job) -> None:
    """What the build will not do as asked, said before it starts."""
    if job.rtx and job.timing_cache is not None:
        job.warnings.append(
            f"timing cache {job.timing_cache} not used: TensorRT-RTX has no autotuning and its timing-cache "
            "operations are no-ops (deprecated in TensorRT-RTX 1.2)"
        )
        job.timing_cache = None
    if job.rtx and job.plugin_calls:
        job.warnings.append(
            f"{len(job.plugin_calls)} plugin call(s) built as their ONNX function bodies: TensorRT-RTX has no plugin layers"
        )
    if job.plan.is_file() and sidecar_path(job.plan).is_file():
        try:
            check_engine_compat(job.plan, read_engine_info(sidecar_path(job.plan)))
        except BuildError as e:
            job.warnings.append(f"replacing {job.plan.name}: {e}")


def _parse(job: _Job, b, logger):
    """The network parsed from the ONNX file (from the file, so that external weights are found beside it),
    with the parser, which must outlive the build: (network, parser)."""
    network = b.create_network(network_flags(job.trt))
    parser = job.trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(job.onnx)):
        errors = []
        for i in range(parser.num_errors):
            e = parser.get_error(i)
            where = f"node '{e.node_name()}' ({e.node_operator()})" if e.node_name() or e.node_operator() else "model"
            why = e.code().name.lower().replace("_", " ")
            desc = e.desc().strip()
            errors.append(f"{where}: {why}" + (f": {desc}" if desc and desc not in ("false", "true") else ""))
        raise BuildError(f"{job.name} could not parse {job.onnx.name}: " + "; ".join(errors or logger.errors))
    return network, parser


def _plugin_layers(job: _Job, network) -> int:
    """The network's PLUGIN_V3 layers; TensorRT must have imported every plugin call as one."""
    trt, calls = job.trt, job.plugin_calls
    n = sum(network.get_layer(i).type == trt.LayerType.PLUGIN_V3 for i in range(network.num_layers))
    if not job.rtx and calls and n < len(calls):
        raise BuildError(
            f"{job.name} {trt.__version__} imported {len(calls) - n} of {len(calls)} plugin call(s) "
            "as their ONNX function bodies, not as the plugin: it needs TensorRT >= 10.7 with the plugin registered"
        )
    return n


def _allow_decomposed_attention(job: _Job, network) -> None:
    """Let each IAttention (the slot decoder's `Attention`, parsed) fall back to several kernels where TensorRT has
    no fused one for its shapes and types (fp32 among them): parsed ones are not decomposable, and their build
    fails ("Attention operation was not supported by a dedicated kernel", TensorRT-RTX 1.7). A fused kernel is
    still taken where one exists (IAttention::setDecomposable)."""
    trt = job.trt
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type == trt.LayerType.ATTENTION_OUTPUT:
            layer.__class__ = trt.IAttentionOutputLayer  # the bindings hand out ILayer: cast to reach .attention
            layer.attention.decomposable = True


def _builder_config(job: _Job, b):
    """The builder config: optimization level, TF32, workspace, stripping, profiles, RTX targets."""
    trt = job.trt
    config = b.create_builder_config()
    config.builder_optimization_level = job.opt_level
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED  # layer names + tactics for the report
    if job.precision == "fp32":  # an fp32 graph is the exact engine: no TF32 GEMMs (the flag defaults to on)
        config.clear_flag(trt.BuilderFlag.TF32)
    if job.workspace_mb is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, job.workspace_mb << 20)
    if job.strip_weights:  # the plan keeps no weight the ONNX can give back; refit with those same weights at load
        config.set_flag(trt.BuilderFlag.STRIP_PLAN)
        config.set_flag(trt.BuilderFlag.REFIT_IDENTICAL)
    for shapes, _ in job.profiles:
        prof = b.create_optimization_profile()
        for tensor, s in shapes.items():
            prof.set_shape(tensor, s["min"], s["opt"], s["max"])
        config.add_optimization_profile(prof)
    if job.rtx and not job.ccs_default:
        config.num_compute_capabilities = len(job.ccs)
        for i, cc in enumerate(job.ccs):
            config.set_compute_capability(getattr(trt.ComputeCapability, "SM" + cc.replace(".", "")), i)
    return config


def _serialize(job: _Job, b, network, config, logger, progress: bool):
    """The serialized engine, built with a progress bar that Ctrl-C cancels."""
    monitor = progress_monitor(job.trt, progress and console.is_terminal, f"Building {job.plan.name} with {job.name}")
    config.progress_monitor = monitor
    with monitor, ctrl_c_cancels(monitor):
        serialized = b.build_serialized_network(network, config)
    if monitor.interrupted:
        raise KeyboardInterrupt
    if serialized is None:
        raise BuildError(f"{job.name} failed to build {job.onnx.name}: " + "; ".join(logger.errors or ["no reason given"]))
    return serialized


def _write_outputs(result: BuildResult, serialized, report: dict | None, cache) -> None:
    """The timing cache, the layer report, the plan and its sidecar, each under a temporary name first; on
    any failure the ones already written are removed, so no plan is left without its sidecar."""
    written: list[Path] = []
    try:
        if cache is not None and result.timing_cache is not None:
            _save_timing_cache(cache, result.timing_cache, result.builder, result.builder_version)
        if report is not None:
            result.layer_report = write_text_atomic(layer_report_path(result.plan), json.dumps(report, indent=1))
            written.append(result.layer_report)
        with atomic_path(result.plan) as tmp:
            with open(tmp, "wb") as f:
                f.write(memoryview(serialized))
            result.plan_bytes, result.plan_sha256 = tmp.stat().st_size, sha256_file(tmp)
            written.append(write_text_atomic(result.sidecar, json.dumps(result.to_dict(), indent=1)))
    except BaseException:
        for p in written:
            p.unlink(missing_ok=True)
        raise


def graph_inputs(graph: onnx.ModelProto) -> list[str]:
    return [i.name for i in graph.graph.input if i.name not in {t.name for t in graph.graph.initializer}]


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


def _load_timing_cache(trt, config, path: Path, builder: str):
    """A timing cache for the config: from `path` when present and made by this TensorRT, else empty."""
    note = None
    data = b""
    if path.is_file():
        meta_path = sidecar_path(path)
        try:
            meta = read_json(meta_path, MAX_JSON_BYTES, "a timing cache's sidecar", BuildError) if meta_path.is_file() else {}
        except BuildError:
            meta = {"unreadable": str(meta_path)}  # then not this TensorRT's: a new cache
        here = {"builder": builder, "builder_version": trt.__version__, "gpu": gpu_compute_capability()}
        if meta and meta != here:
            note = f"timing cache {path} was made by {meta} and this is {here}: starting a new one"
        else:
            data = path.read_bytes()
    cache = config.create_timing_cache(data)
    if not config.set_timing_cache(cache, False):
        note = f"timing cache {path} was rejected by {BUILDER_NAMES[builder]}: starting a new one"
        cache = config.create_timing_cache(b"")
        config.set_timing_cache(cache, False)
    return cache, note


def _save_timing_cache(cache, path: Path, builder: str, version: str) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(memoryview(cache.serialize()))
    meta = {"builder": builder, "builder_version": version, "gpu": gpu_compute_capability()}
    write_text_atomic(sidecar_path(path), json.dumps(meta, indent=1))

"""TensorRT backend (GPU hosts only): the decoder engine built from `decoder.onnx` with the two
optimization profiles of `kvcache.optimization_profiles` (prefill, decode). Kept thin; it cannot run on
the CPU-only development machines, and its tests are skipped there.

Memory: every device buffer is allocated once, in __init__, sized for the largest shapes the profiles
allow (batch 1: n_positions tokens); no step allocates. TensorRT writes straight into them
(`set_tensor_address`), and the host sees only the token id going in and the logits coming out.

One execution context per profile, each keeping its own profile selected.

Threads: a TrtSession keeps its one cache in the session (the buffers above, the execution contexts, the
captured CUDA graph, all on one stream), so it is a `SerialSession`: calls from several threads take turns
under a lock, one sequence at a time (a batch of prompts runs one prompt after another); close() takes the
same lock, so it waits for a running call before it frees the buffers. For parallel requests on one GPU,
load one session per worker.

Decode has two modes:

- `cuda_graph=False`: the cache grows by one each step. Two sets of cache buffers, A and B, alternate:
  step with past P reads set P % 2 and writes `present` (P+1 long) into the other. Shapes change every
  step, so no CUDA graph.
- `cuda_graph=True` (default): fixed shapes, so the step is captured once as a CUDA graph and replayed.
  The past is always n_positions-1 slots long; slots not yet filled are masked out by `attention_mask`
  (0), and the new token is the last position. Attention ignores key order and the graph derives positions
  from the mask, so this computes the same function as the growing cache. After each replay the new
  token's key/value (last slot of `present`) is copied into slot P of the past (2 x n_layer small strided
  copies). Trade-off: every step attends over n_positions keys, but a batch-1 decode on a GPU is bound by
  kernel launches, which the graph removes. If capture fails (an engine that cannot be captured), the
  same fixed-shape step runs through execute_async_v3 and `cuda_graph_active` says so; `capture=False`
  takes that path on purpose (the build's engine check runs it, so that the fallback is checked too).

Element types: every buffer's element size and every host array's dtype come from the engine
(`get_tensor_dtype`), never from the ONNX graph beside it: an fp16 or bf16 build keeps its KV cache in
2-byte elements, and a `.plan` loaded on its own may lie beside the fp32 `decoder.onnx`.

Written against the TensorRT 10 Python API (execute_async_v3, set_input_shape, set_tensor_address,
set_optimization_profile_async) and cuda-python's runtime bindings; TensorRT-RTX (`tensorrt_rtx`) exposes
the same calls.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from ..config import ModelConfig
from ..errors import CudaError, InputError, MissingDependency, require
from ..graphs.layout import KVLayout
from ..names import ATTENTION_MASK, DECODE, INPUT_IDS, LOGITS, PREFILL
from .base import SerialSession


def _tensorrt():
    """`tensorrt`, else `tensorrt_rtx`; MissingDependency if neither is usable."""
    try:
        import tensorrt as trt

        if hasattr(trt, "Runtime"):  # `tensorrt-stubs` alone leaves an empty namespace package
            return trt
    except ImportError:
        pass
    try:
        import tensorrt_rtx as trt

        return trt
    except ImportError as e:
        raise MissingDependency(
            "The TensorRT runtime needs the Python module 'tensorrt' (or 'tensorrt_rtx'), which could not be "
            "imported. Install it with: pip install 'andrea-export[tensorrt]'"
        ) from e


def _cudart():
    from ..errors import gpu_compute_capability

    if gpu_compute_capability() is None:  # said first: without a GPU, no CUDA package would help
        raise InputError("no GPU on this machine (or no working driver), and the TensorRT backend runs the engine on "
                         "an NVIDIA GPU; use --backend onnxruntime")
    return cuda_runtime()


def cuda_runtime():
    """cuda-python's runtime bindings, which the TensorRT session (and so the build's engine check) drives; else
    MissingDependency naming the extra that installs them."""
    try:
        from cuda.bindings import runtime as cudart  # cuda-python >= 12.6
    except ImportError:
        cudart = require("cuda.cudart", "tensorrt", "Running TensorRT engines (the runtime's TensorRT session)")
    return cudart


def _numpy_dtypes(trt) -> dict:
    """TensorRT DataType -> numpy dtype, for the types a decoder engine's I/O may have."""
    import ml_dtypes  # numpy has no bfloat16; onnx depends on ml_dtypes

    D = trt.DataType
    return {D.FLOAT: np.dtype(np.float32), D.HALF: np.dtype(np.float16), D.BF16: np.dtype(ml_dtypes.bfloat16),
            D.INT32: np.dtype(np.int32), D.INT64: np.dtype(np.int64)}


def _ok(cudart, result, what: str):
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cudart.cudaError_t.cudaSuccess:
        raise CudaError(f"{what} failed: {err}")
    return values[0] if len(values) == 1 else values


def _engine_info(engine_path: Path) -> dict:
    """The build's sidecar beside the engine (`<plan>.json`: what built it, for which GPU, its plugin layers), or {}."""
    from ..engine.refit import sidecar_path
    from ..userfiles import MAX_JSON_BYTES, read_json

    side = sidecar_path(engine_path)
    info = read_json(side, MAX_JSON_BYTES, "an engine sidecar", InputError) if side.is_file() else {}
    return info if isinstance(info, dict) else {}


def _refit_if_stripped(trt, engine, engine_path: Path, info: dict) -> None:
    """A weight-stripped engine (its .plan.json says so) gets its weights from the ONNX beside it
    (engine/refit.py, which imports nothing of the builder: a runtime loads without the build machinery)."""
    from ..engine.refit import refit_stripped

    if info.get("weights_stripped"):
        refit_stripped(trt, engine, engine_path, info)


def _gpu_compute_capability(cudart) -> str | None:
    """This GPU's compute capability ("8.9") as the CUDA runtime the session drives reports it; None if it cannot say."""
    try:
        device = _ok(cudart, cudart.cudaGetDevice(), "cudaGetDevice")
        attr = cudart.cudaDeviceAttr
        major, minor = (_ok(cudart, cudart.cudaDeviceGetAttribute(a, device), "cudaDeviceGetAttribute")
                        for a in (attr.cudaDevAttrComputeCapabilityMajor, attr.cudaDevAttrComputeCapabilityMinor))
    except (CudaError, AttributeError, TypeError, ValueError):
        return None
    return f"{int(major)}.{int(minor)}"


def _installed(trt) -> tuple[str, str]:
    """(builder, version) of the TensorRT module the session runs: ("tensorrt", "10.13.3.9"), ("tensorrt-rtx", ...)."""
    from ..engine.backends import BUILDER_MODULES

    name = getattr(trt, "__name__", "tensorrt")
    builder = next((b for b, (module, _) in BUILDER_MODULES.items() if module == name), "tensorrt")
    return builder, str(getattr(trt, "__version__", "?"))


def _check_built_for_here(trt, cudart, engine_path: Path, info: dict) -> None:
    """The build's sidecar against this process, before TensorRT is asked: TensorRT refuses an engine of another
    version ("By default, TensorRT engines are compatible only with the version of TensorRT used to build them") or
    one built for another GPU architecture (not portable across them without hardware compatibility, which these
    builds do not use), and says why only in its log. InputError naming what differs; nothing when the sidecar does
    not say. TensorRT-RTX's several targets, and its JIT, are left to TensorRT-RTX."""
    from ..engine.backends import BUILDER_MODULES, BUILDER_NAMES
    from ..engine.refit import sidecar_path

    here, version = _installed(trt)
    builder, recorded = info.get("builder"), info.get("builder_version")
    side = sidecar_path(engine_path).name
    if builder in BUILDER_NAMES and recorded is not None and (builder, str(recorded)) != (here, version):
        fix = (f"install {BUILDER_MODULES[builder][0]}=={recorded}" if builder == here
               else f"rebuild it with --builder {here}")
        raise InputError(f"{engine_path}: built with {BUILDER_NAMES[builder]} {recorded} ({side} says), but this process "
                         f"has {BUILDER_NAMES[here]} {version}; TensorRT loads an engine only in the version that built "
                         f"it: rebuild it here, or {fix}")
    targets = [str(t) for t in info.get("compute_capabilities") or []]
    cc = _gpu_compute_capability(cudart)
    if builder == "tensorrt" and targets and "?" not in targets and cc is not None and cc not in targets:
        raise InputError(f"{engine_path}: built for compute capability {', '.join(targets)} ({side} says), but this GPU "
                         f"is {cc}; a TensorRT engine runs only on the compute capability it was built for: rebuild it "
                         "on this GPU")


def _not_deserialized(trt, cudart, engine_path: Path, info: dict) -> str:
    """Why TensorRT most likely returned no engine, from what the sidecar records against this process (the last
    resort: _check_built_for_here found nothing, or there is no sidecar). TensorRT's own reason is only in its log."""
    from ..engine.backends import BUILDER_NAMES
    from ..engine.refit import sidecar_path
    from ..folder.atomic import sha256_file
    from ..plugin import GELU_BIAS_OP, GELU_OP, PLUGIN_NAMESPACE, PLUGIN_VERSION

    here, version = _installed(trt)
    name, cc, side = f"{BUILDER_NAMES[here]} {version}", _gpu_compute_capability(cudart), sidecar_path(engine_path).name
    head = f"{engine_path}: {name} could not deserialize this engine (TensorRT's own error is in the log above)"
    creators = f"{PLUGIN_NAMESPACE}::{GELU_OP}, {PLUGIN_NAMESPACE}::{GELU_BIAS_OP}, version {PLUGIN_VERSION}"
    if not info:
        return (f"{head}, and no {side} beside it records what built it. Likely causes: it was built by another "
                f"TensorRT version (this is {name}; an engine loads only in the version that built it), or for another "
                f"GPU (this one is compute capability {cc or 'unknown'}; an engine runs only on the compute capability "
                "it was built for, unless built hardware-compatible), or it has plugin layers whose creators are not "
                f"registered in this process (such as {creators}; an AOT plugin's kernel is in the engine, which then "
                "needs none). Rebuild it here")
    builder, ccs = info.get("builder"), [str(t) for t in info.get("compute_capabilities") or []]
    targets = ", ".join(ccs) or "?"
    built = f"{BUILDER_NAMES.get(builder or '?', builder)} {info.get('builder_version')}, compute capability {targets}"
    checked = builder == here and cc is not None and cc in ccs
    about = (f"What built it ({side}: {built}) matches this process ({name}, compute capability {cc})" if checked
             else f"It was built by {built} ({side} says); this process has {name}, compute capability {cc or 'unknown'}")
    causes = []
    if info.get("plan_sha256") and sha256_file(engine_path) != info["plan_sha256"]:
        causes.append(f"the file is not the engine {side} describes (its sha256 differs): rebuild it")
    if not checked and builder == here and cc is not None:
        causes.append(f"this GPU ({cc}) may not be one it was built for ({targets})")
    if info.get("plugin_layers"):
        causes.append(f"its {info['plugin_layers']} plugin layers need their plugin creators ({creators}) registered in "
                      "this process, unless they were built ahead of time (AOT: the kernel is in the engine and no "
                      "creator is needed; the log above names a creator TensorRT could not find): load it where they "
                      "are registered (andrea_export.plugin.register.register_plugins()), or rebuild it with the AOT "
                      "plugins")
    if not causes:
        causes.append("none that the build's record shows (a damaged file, a driver too old for it, or too little GPU "
                      "memory: see the log above)")
    return f"{head}. {about}. Likely cause: " + "; ".join(causes)


def engine_dtypes(trt, engine, layout: KVLayout, source: str, prefixes: tuple[str, ...] = ("",)) -> dict[str, np.dtype]:
    """Each I/O tensor's numpy dtype from the engine (its tensors named as `layout`'s, once per prefix: the slot
    engine's two groups); InputError for types or sizes this runtime cannot drive (integer ids and mask,
    floating logits, one floating type for the whole cache, the cache's [batch, heads, length, head_dim])."""
    L = layout
    known = _numpy_dtypes(trt)
    out = {}
    for p in prefixes:
        for t in L.inputs + L.outputs:
            dt = engine.get_tensor_dtype(p + t.name)
            if dt not in known:
                raise InputError(f"{source}: engine tensor '{p + t.name}' has type {dt}, which this runtime cannot drive")
            out[p + t.name] = known[dt]
    caches = [p + name for p in prefixes for name in L.past_names + L.present_names]
    cache = {out[name] for name in caches}
    floating = np.dtype(np.float32), np.dtype(np.float16), known[trt.DataType.BF16]
    logits = {out[p + LOGITS] for p in prefixes}
    if len(cache) != 1 or not cache <= set(floating) or not logits <= set(floating):
        raise InputError(f"{source}: engine KV cache types {sorted(str(d) for d in cache)} and logits type "
                         f"{', '.join(sorted(str(d) for d in logits))}: expected one floating type for the cache and "
                         "floating logits")
    if not all(out[p + name].kind == "i" for p in prefixes for name in (INPUT_IDS, ATTENTION_MASK)):
        raise InputError(f"{source}: engine '{INPUT_IDS}' / '{ATTENTION_MASK}' are not integer tensors")
    for name in caches:  # the sizes behind every buffer and copy
        shape = tuple(engine.get_tensor_shape(name))
        if len(shape) != 4 or (shape[1], shape[3]) != (L.n_head, L.head_dim):
            raise InputError(f"{source}: engine tensor '{name}' has shape {list(shape)}, the model's KV layout "
                             f"[batch, {L.n_head}, length, {L.head_dim}]")
    if any(tuple(engine.get_tensor_shape(p + LOGITS))[-1] != L.vocab_size for p in prefixes):
        raise InputError(f"{source}: engine logits are not over the model's {L.vocab_size} tokens")
    return out


def load_engine(trt, cudart, engine_path: Path):
    """(runtime, engine) of the plan at `engine_path`: what its sidecar says is checked against this process
    first, TensorRT's refusal explained from it, a weight-stripped engine refitted from the ONNX beside it."""
    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    info = _engine_info(engine_path)
    _check_built_for_here(trt, cudart, engine_path, info)  # what the sidecar can tell, said before TensorRT refuses
    engine = runtime.deserialize_cuda_engine(engine_path.read_bytes())
    if engine is None:
        raise InputError(_not_deserialized(trt, cudart, engine_path, info))
    _refit_if_stripped(trt, engine, engine_path, info)
    return runtime, engine


def bind(ctx, shapes: dict[str, tuple], addresses: dict[str, int]) -> None:
    """Set input shapes, then tensor addresses, on a TensorRT execution context. TensorRT reports a refusal
    (a shape outside the profile, an unknown name, a misaligned pointer) by returning False, not by raising:
    unchecked, the next enqueue runs on stale bindings."""
    for name, shape in shapes.items():
        if not ctx.set_input_shape(name, tuple(shape)):
            raise CudaError(f"TensorRT refused shape {list(shape)} for '{name}' (outside the profile?)")
    for name, ptr in addresses.items():
        if not ctx.set_tensor_address(name, int(ptr)):
            raise CudaError(f"TensorRT refused the address of '{name}' (unknown name, or not 256-byte aligned)")


def enqueue(ctx, stream) -> None:
    """execute_async_v3 on `stream`; False (nothing enqueued) raises."""
    if not ctx.execute_async_v3(stream):
        raise CudaError("TensorRT execute_async_v3 failed (see the log above)")


def capture(cudart, stream, work):
    """The executable CUDA graph of what `work()` puts on `stream` (thread-local capture); CudaError if it cannot
    be captured (an engine with data-dependent shapes, a pageable copy, ...)."""
    graph = None
    try:
        _ok(cudart, cudart.cudaStreamBeginCapture(stream, cudart.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal),
            "cudaStreamBeginCapture")
        try:
            work()
        finally:  # end the capture whatever happened; a failed enqueue still leaves a graph to destroy
            err, graph = cudart.cudaStreamEndCapture(stream)
        _ok(cudart, (err,), "cudaStreamEndCapture")
        return _ok(cudart, cudart.cudaGraphInstantiate(graph, 0), "cudaGraphInstantiate")
    finally:
        if graph is not None:  # the executable keeps what it needs
            cudart.cudaGraphDestroy(graph)


class TrtSession(SerialSession):
    backend = "tensorrt"

    def __init__(self, engine_path: str | Path, cfg: ModelConfig, layout: KVLayout, *, cuda_graph: bool = True,
                 capture: bool = True):
        super().__init__(cfg, layout, str(engine_path))
        self.cudart = _cudart()  # first: on a machine without a GPU, that is what to say
        self.trt = _tensorrt()
        self._buffers: list[int] = []
        self.cuda_stream: int | None = None
        self._graph_exec = None
        self.cuda_graph_active = False
        self.cuda_graph_error: str | None = None
        try:
            self._load(Path(engine_path), cuda_graph, capture)
        except BaseException:  # a session that fails to load frees what it took
            self._closed = True
            self._release()
            raise

    def _load(self, engine_path: Path, cuda_graph: bool, capture: bool):
        rt, trt, cfg, layout = self.cudart, self.trt, self.cfg, self.layout
        self.cuda_stream = int(_ok(rt, rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreate"))
        self._runtime, self.engine = load_engine(trt, rt, engine_path)
        self._check_engine()
        self.dtypes = engine_dtypes(trt, self.engine, layout, self.source)  # tensor name -> numpy dtype, the engine's
        # the cache's element type is the engine's (fp16/bf16 builds), whatever graph the layout was read from
        self.layout = layout = dataclasses.replace(layout, cache_dtype=self.dtypes[layout.past_names[0]].name)

        self.contexts = {}
        for name, index in self._profile_indices().items():
            ctx = self.engine.create_execution_context()
            if not ctx.set_optimization_profile_async(index, self.cuda_stream):
                raise InputError(f"{engine_path}: cannot select optimization profile {index} ({name})")
            self.contexts[name] = ctx
        self._sync()

        n, H, V = cfg.n_positions, layout.n_head, layout.vocab_size
        ids_t, mask_t, logits_t = self.dtypes[INPUT_IDS], self.dtypes[ATTENTION_MASK], self.dtypes[LOGITS]
        self._row = layout.head_dim * self.dtypes[layout.past_names[0]].itemsize  # one token, one head: bytes
        self._ids = self._alloc(n * ids_t.itemsize)
        self._mask_ones = self._alloc(n * mask_t.itemsize)  # all ones: prefill and the growing-cache decode
        self._upload(self._mask_ones, np.ones(n, dtype=mask_t))
        self._logits = self._alloc(n * V * logits_t.itemsize)
        self._host_logits = np.empty((n, V), dtype=logits_t)
        self._tok = np.zeros(1, dtype=ids_t)  # host sources of async copies live as long as the session
        self._one = np.ones(1, dtype=mask_t)
        self._len = 0
        self.static = cuda_graph
        kv = H * n * self._row  # one cache tensor at full length
        self._present = [self._alloc(kv) for _ in layout.present_names]
        if self.static:
            past_bytes = H * (n - 1) * self._row
            self._past = [self._alloc(past_bytes) for _ in layout.past_names]
            for p in self._past:  # unfilled slots are masked, but weights of 0 times a NaN would still be NaN
                _ok(rt, rt.cudaMemsetAsync(p, 0, past_bytes, self.cuda_stream), "cudaMemsetAsync")
            self._mask_static = self._alloc(n * mask_t.itemsize)
            # valid ids and mask before the warm-up run: garbage ids would index the embedding out of bounds
            self._upload(self._ids, np.zeros(n, dtype=ids_t))
            self._upload(self._mask_static, np.eye(1, n, n - 1, dtype=mask_t)[0])
            self._bind_static_decode()
            if capture:
                self._capture()
            else:
                self.cuda_graph_error = "not captured: capture=False (the fallback path, run on purpose)"
        else:
            self._past_b = [self._alloc(kv) for _ in layout.past_names]  # set B; set A is self._present

    # -- setup -------------------------------------------------------------------------------------------
    def _check_engine(self):
        names = {self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)}
        want = {t.name for t in self.layout.inputs + self.layout.outputs}
        if names != want:
            raise InputError(
                f"{self.source}: engine I/O {sorted(names)} is not the KV-cache decoder layout {sorted(want)}"
            )
        if self.engine.num_optimization_profiles < 2:
            raise InputError(
                f"{self.source}: the engine has {self.engine.num_optimization_profiles} optimization profile(s); "
                f"the runtime needs the prefill and decode profiles (kvcache.optimization_profiles)"
            )

    def _profile_indices(self) -> dict[str, int]:
        """Which profile is prefill (past max 0, many tokens) and which decode (1 token, long past)."""
        found: dict[str, int] = {}
        past0 = self.layout.past_names[0]
        n = self.cfg.n_positions
        for i in range(self.engine.num_optimization_profiles):
            _, _, past_max = self.engine.get_tensor_profile_shape(past0, i)
            ids_min, _, ids_max = self.engine.get_tensor_profile_shape(INPUT_IDS, i)
            if past_max[2] == 0 and ids_max[1] >= n:
                found.setdefault(PREFILL, i)
            elif ids_min[1] <= 1 <= ids_max[1] and past_max[2] >= n - 1:
                found.setdefault(DECODE, i)
        missing = [p for p in (PREFILL, DECODE) if p not in found]
        if missing:
            raise InputError(
                f"{self.source}: no optimization profile fits {', '.join(missing)} "
                f"(see kvcache.optimization_profiles for the shapes the runtime needs)"
            )
        return found

    def _alloc(self, nbytes: int) -> int:
        ptr = _ok(self.cudart, self.cudart.cudaMalloc(max(nbytes, 256)), "cudaMalloc")
        self._buffers.append(ptr)
        return int(ptr)

    def _upload(self, dst: int, host: np.ndarray, offset: int = 0):
        rt = self.cudart
        _ok(rt, rt.cudaMemcpyAsync(dst + offset, host.ctypes.data, host.nbytes, rt.cudaMemcpyKind.cudaMemcpyHostToDevice,
                                   self.cuda_stream), "cudaMemcpyAsync H2D")

    def _sync(self):
        _ok(self.cudart, self.cudart.cudaStreamSynchronize(self.cuda_stream), "cudaStreamSynchronize")

    def _bind(self, ctx, shapes: dict[str, tuple], addresses: dict[str, int]):
        bind(ctx, shapes, addresses)

    def _execute(self, ctx):
        enqueue(ctx, self.cuda_stream)

    def _bind_static_decode(self):
        L, n, H, D = self.layout, self.cfg.n_positions, self.layout.n_head, self.layout.head_dim
        shapes = {INPUT_IDS: (1, 1), ATTENTION_MASK: (1, n), **{p: (1, H, n - 1, D) for p in L.past_names}}
        addresses = {INPUT_IDS: self._ids, ATTENTION_MASK: self._mask_static, LOGITS: self._logits,
                     **dict(zip(L.past_names, self._past)), **dict(zip(L.present_names, self._present))}
        self._bind(self.contexts[DECODE], shapes, addresses)

    def _capture(self):
        """Run the fixed-shape decode step once (TensorRT finishes shape-dependent setup on the first
        enqueue), then capture it as a CUDA graph."""
        ctx = self.contexts[DECODE]
        self._execute(ctx)
        self._sync()
        try:
            self._graph_exec = capture(self.cudart, self.cuda_stream, lambda: self._execute(ctx))
            self.cuda_graph_active = True
        except CudaError as e:  # e.g. an engine with data-dependent shapes: run the same step uncaptured
            self.cuda_graph_error = str(e)
            self.cudart.cudaGetLastError()

    # -- steps -------------------------------------------------------------------------------------------
    def _prefill(self, ids: list[int]) -> np.ndarray:
        L, H, D, T = self.layout, self.layout.n_head, self.layout.head_dim, len(ids)
        rt = self.cudart
        self._upload(self._ids, np.asarray(ids, dtype=self.dtypes[INPUT_IDS]))
        present = self._present if (self.static or T % 2 == 0) else self._past_b  # dynamic: set T % 2
        shapes = {INPUT_IDS: (1, T), ATTENTION_MASK: (1, T), **{p: (1, H, 0, D) for p in L.past_names}}
        addresses = {INPUT_IDS: self._ids, ATTENTION_MASK: self._mask_ones, LOGITS: self._logits,
                     **{p: self._logits for p in L.past_names},  # empty tensors: any valid address
                     **dict(zip(L.present_names, present))}
        self._bind(self.contexts[PREFILL], shapes, addresses)
        self._execute(self.contexts[PREFILL])
        if self.static:  # scatter the prompt's keys/values into slots 0..k-1 of the fixed-length past
            n, row = self.cfg.n_positions, self._row
            k = min(T, n - 1)  # a full-context prompt (T = n) fills the past; no token can follow it
            for src, dst in zip(self._present, self._past):
                _ok(rt, rt.cudaMemcpy2DAsync(dst, (n - 1) * row, src, T * row, k * row, H,
                                             rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice, self.cuda_stream), "cudaMemcpy2DAsync")
            mask = np.zeros(n, dtype=self.dtypes[ATTENTION_MASK])
            mask[:k] = 1
            mask[-1] = 1  # the new token's own slot
            self._upload(self._mask_static, mask)
        self._len = T
        return self._download(T)

    def _decode(self, token: int) -> np.ndarray:
        rt, L, P = self.cudart, self.layout, self._len
        H, D, n, row = L.n_head, L.head_dim, self.cfg.n_positions, self._row
        if P >= n:
            raise InputError(f"the context of {n} tokens is full: no token can follow")
        self._tok[0] = token
        self._upload(self._ids, self._tok)
        if self.static:
            if self._graph_exec is not None:
                _ok(rt, rt.cudaGraphLaunch(self._graph_exec, self.cuda_stream), "cudaGraphLaunch")
            else:
                self._execute(self.contexts[DECODE])
            for src, dst in zip(self._present, self._past if P < n - 1 else ()):  # new key/value -> past slot P
                _ok(rt, rt.cudaMemcpy2DAsync(dst + P * row, (n - 1) * row, src + (n - 1) * row, n * row,
                                             row, H, rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice, self.cuda_stream),
                    "cudaMemcpy2DAsync")  # (P = n - 1: the context is now full, nothing reads the past again)
            self._upload(self._mask_static, self._one, offset=P * self._one.itemsize)
        else:
            past, present = (self._present, self._past_b) if P % 2 == 0 else (self._past_b, self._present)
            shapes = {INPUT_IDS: (1, 1), ATTENTION_MASK: (1, P + 1), **{p: (1, H, P, D) for p in L.past_names}}
            addresses = {INPUT_IDS: self._ids, ATTENTION_MASK: self._mask_ones, LOGITS: self._logits,
                         **dict(zip(L.past_names, past)), **dict(zip(L.present_names, present))}
            self._bind(self.contexts[DECODE], shapes, addresses)
            self._execute(self.contexts[DECODE])
        self._len = P + 1
        return self._download(1)[0]

    def _download(self, rows: int) -> np.ndarray:
        rt = self.cudart
        out = self._host_logits[:rows]
        _ok(rt, rt.cudaMemcpyAsync(out.ctypes.data, self._logits, out.nbytes, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost,
                                   self.cuda_stream), "cudaMemcpyAsync D2H")
        self._sync()
        return out.astype(np.float32)  # a copy, float32 whatever the engine's logits type

    def _release(self) -> None:  # SerialSession.close: under the session lock, once
        rt = self.cudart
        if self.cuda_stream is not None:  # a step that raised part-way may have left work queued on it
            rt.cudaStreamSynchronize(self.cuda_stream)  # its error, if any, was the step's to report
        if self._graph_exec is not None:
            rt.cudaGraphExecDestroy(self._graph_exec)
            self._graph_exec = None
        for ptr in self._buffers:
            rt.cudaFree(ptr)
        self._buffers = []
        self.contexts = {}  # contexts before their engine, the engine before its runtime: TensorRT's order
        self.engine = None
        self._runtime = None
        if self.cuda_stream is not None:
            rt.cudaStreamDestroy(self.cuda_stream)
            self.cuda_stream = None

    def __del__(self):  # a session nobody closed still gives its device memory back
        if not getattr(self, "_closed", True) and getattr(self, "cudart", None) is not None:
            try:
                self.close()
            except Exception:  # at interpreter exit the CUDA bindings may be gone already
                pass

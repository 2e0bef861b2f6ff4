"""Strict CPU stand-ins for cuda-python's runtime bindings (`cuda.bindings.runtime`) and TensorRT's Python
runtime API, for testing `andrea_export.runtime.trt.TrtSession` where there is no GPU.

"Device memory" is host memory, but it is handed out and checked the way the CUDA runtime does:

- every allocation has a size; every copy, memset and TensorRT tensor access is bounds-checked against the
  allocation it starts in, and may not run past its end (the real driver rejects a copy over unmapped memory
  and a kernel faults; the stand-in is stricter and rejects any overrun, even into a neighbour);
- `cudaMemcpy2DAsync` returns cudaErrorInvalidPitchValue when width exceeds dpitch or spitch, like the
  real call (its documented contract: "width must not exceed either dpitch or spitch");
- copy directions are checked (a HostToDevice copy needs a device destination and a host source, ...);
- work on a stream that is being captured is recorded, not run; a captured graph replays exactly the
  recorded operations, with the arguments they had when recorded (TensorRT's enqueue included: its tensor
  shapes and addresses are baked in at capture time); a captured enqueue replayed while its context is bound
  to other shapes or addresses faults (TensorRT is silent there; NVIDIA's TensorRT-Edge-LLM replays a graph only
  when the context's bindings equal those it was captured with, cpp/runtime/exec/engineExecutor.cpp, and a
  runtime held to that here holds there); cudaStreamSynchronize, cudaMalloc or cudaMallocHost
  during a thread-local capture fail with cudaErrorStreamCaptureUnsupported and invalidate the capture;
- a copy to or from pageable host memory (anything cudaMallocHost did not hand out) during a capture fails
  the same way. The runtime API's cudaMemcpyAsync reference said so outright ("It only works on
  page-locked host memory and returns an error if a pointer to pageable memory is passed"); later drivers
  may stage such a copy, but a graph node over a pageable address reads or writes whatever lives there at
  each replay, with nothing keeping it alive, and PyTorch refuses it during capture for that reason. The
  stand-in takes the strict reading: a runtime that passes here passes there. Outside a capture a pageable
  copy is legal (staged, synchronous for the host), as in CUDA;
- a replay re-checks every recorded copy and memset against the allocations (device and page-locked) alive
  at that moment, as the enqueue's tensor accesses are: memory freed since the capture faults;
- graphs, graph executables, streams and allocations are counted, so a test can say nothing leaked;
- a kernel (TensorRT enqueue) that touches memory outside an allocation leaves the sticky
  cudaErrorIllegalAddress that the next synchronize reports, as a device fault does.
- `set_tensor_address` refuses (returns False) a pointer that is not 256-byte aligned, as TensorRT's
  header says it must be ("The pointer must have at least 256-byte alignment", NvInferRuntime.h 10.9/11.1):
  a tensor bound at an offset inside a larger allocation must sit on a 256-byte boundary.

The TensorRT stand-in reads the ONNX graph an engine "was built from" (the fake plan is a small JSON file
naming it and the optimization profiles) and reports what a strongly typed engine built from that graph
reports: each I/O tensor's DataType from the graph (float32 / float16 / bfloat16 cache, int64 ids and mask,
float32 logits), its shape with -1 for dynamic axes, and the profiles' min/opt/max. Execution runs the real
graph through ONNX Runtime on the bytes at the bound addresses, viewed with the engine's dtypes. A plugin graph
(each tanh-GELU a call of andrea.TanhGelu / TanhGeluBias, what a TensorRT build hands the builder) runs each call
as the plugin kernel computes it (`kernel_error_model`): float32 math from the storage dtype, tanh off by the
full relative error of the entry point that storage picks (plugin/reference.py's TANH_REL_ERR), one rounding
back to the storage. ONNX Runtime's
CPU provider has no bf16 kernels, so a bf16 graph runs as `precision.emulate_in_fp32` of itself: every op
rounded to bf16, bf16 tensors widened exactly to float32 on the way in and narrowed (exactly: the values are
already bf16-rounded) on the way out. The signatures follow cuda-python 12.x/13.x (every call returns a tuple
whose first element is a cudaError_t) and TensorRT 10/11 (`execute_async_v3`, `set_tensor_address`, ...).

A fake plan also records what a real one carries about where it may load: the TensorRT version that built it,
the compute capability it was built for (and its hardware-compatibility level), and the plugin creators its
plugin layers came from, each marked AOT or not. `deserialize_cuda_engine` checks them like TensorRT does and,
like TensorRT, returns None and says why only through the Logger (TensorRT's own wording):

- another TensorRT version: "By default, TensorRT engines are compatible only with the version of TensorRT used
  to build them" (docs, Engine Compatibility / Version Compatibility; version-compatible builds are not modelled:
  this project does not make them);
- another compute capability: without hardware compatibility "engines are not portable across different GPU
  architectures" (Support Matrix, Engine Portability); level AMPERE_PLUS runs on compute capability 8.0 and up,
  SAME_COMPUTE_CAPABILITY (like NONE here, where every GPU of one capability is the same) on the same;
- a plugin layer whose creator is not in the process's plugin registry ("Cannot deserialize plugin since
  corresponding IPluginCreator not found in Plugin Registry"), except an AOT plugin's: its kernel is part of
  the engine, which "does not require any Python modules or definitions to be present at runtime" and runs on
  the standard TensorRT runtime, trtexec included (NVIDIA/TensorRT samples/python/quickly_deployable_plugins,
  README, "Loading and running a TRT engine containing an AOT plugin").

A slot decoder's engine (graphs/slot_decoder.py: TensorScatter into a static cache, standard Attention) gets
TensorRT >= 10.15's contracts for its KV-cache-update layers, each stricter where TensorRT is silent:

- write_plan refuses to "build" one with a TensorRT older than 10.15 (no KV-cache-update layer), or whose
  Attention has inputs or outputs TensorRT's parser ignores or refuses (`past_key`, `past_value`,
  `nonpad_kv_seqlen`: ignored silently; `present_*`, `qk_matmul_output`: refused) (operators.md, 10.15);
- `ICudaEngine.get_aliased_input_tensor(output)` names the `past_key_values.*` input each `present.*` is the
  KV-cache update of (None for other tensors), and only a TensorRT >= 10.15 has the method;
- `execute_async_v3` fails (an API error in the log) when an aliased output is not bound to its input's address
  ("If different addresses are assigned, TensorRT reports an API error");
- a write past the cache's end faults (sticky, like an illegal address) where TensorRT drops it silently;
- an update writes only its new positions (in place: the rest of the cache is never copied back), and two
  updates of one enqueue (the two groups of a mixed step) writing the same position of one cache row fault,
  since their order on a GPU is TensorRT's;
- an `is_causal` Attention whose query and key lengths differ fails the enqueue: TensorRT takes it as
  upper-left, ONNX as lower-right, so the two compute different things there.

The GPU's compute capability is the fake device's (FakeCudart(compute_capability=...), which answers
cudaDeviceGetAttribute as the runtime does); the installed TensorRT version and the registered plugin creators
are fake_tensorrt's arguments. The defaults load every plan write_plan writes by default.
"""

from __future__ import annotations

import bisect
import ctypes
import enum
import json
import sys
import types
from pathlib import Path

import numpy as np
from trt_enums import DataType  # tests/: shared with plugin/trt_standin.py


class cudaError_t(enum.IntEnum):  # the values of CUDA's driver_types.h
    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorMemoryAllocation = 2
    cudaErrorInvalidPitchValue = 12
    cudaErrorInvalidDevice = 101
    cudaErrorInvalidDevicePointer = 17
    cudaErrorInvalidMemcpyDirection = 21
    cudaErrorInvalidResourceHandle = 400
    cudaErrorIllegalState = 401
    cudaErrorIllegalAddress = 700
    cudaErrorStreamCaptureUnsupported = 900
    cudaErrorStreamCaptureInvalidated = 901


class cudaMemcpyKind(enum.IntEnum):
    cudaMemcpyHostToHost = 0
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2
    cudaMemcpyDeviceToDevice = 3
    cudaMemcpyDefault = 4


class cudaDeviceAttr(enum.IntEnum):  # driver_types.h
    cudaDevAttrComputeCapabilityMajor = 75
    cudaDevAttrComputeCapabilityMinor = 76


class cudaStreamCaptureMode(enum.IntEnum):
    cudaStreamCaptureModeGlobal = 0
    cudaStreamCaptureModeThreadLocal = 1
    cudaStreamCaptureModeRelaxed = 2


class Handle:
    """An opaque CUDA handle (cudaStream_t, cudaGraph_t, cudaGraphExec_t): `int()` gives its address."""

    def __init__(self, kind: str, value: int):
        self.kind, self.value = kind, value

    def __int__(self):
        return self.value

    def __repr__(self):
        return f"<{self.kind} {self.value:#x}>"


class _Fault(Exception):
    """A kernel touched memory outside every allocation."""


OK = (cudaError_t.cudaSuccess,)
ALIGN = 256  # cudaMalloc's alignment
TRT_VERSION = "10.13.3"  # the TensorRT fake_tensorrt "is" and write_plan's plans were "built" with, by default
COMPUTE_CAPABILITY = "9.0"  # the fake GPU's, and what write_plan's plans were "built" for, by default
HARDWARE_COMPATIBILITY = ("NONE", "AMPERE_PLUS", "SAME_COMPUTE_CAPABILITY")  # trt.HardwareCompatibilityLevel


class FakeCudart:
    """cuda.bindings.runtime, on host memory, enforcing the contracts listed in the module docstring."""

    cudaError_t = cudaError_t
    cudaDeviceAttr = cudaDeviceAttr
    cudaMemcpyKind = cudaMemcpyKind
    cudaStreamCaptureMode = cudaStreamCaptureMode
    cudaStreamDefault = 0
    cudaStreamNonBlocking = 1

    def __init__(self, compute_capability: str = COMPUTE_CAPABILITY):
        self.compute_capability = compute_capability  # the one GPU's (device 0), "8.9"
        self._blocks: dict[int, np.ndarray] = {}  # base address -> its bytes (a view of a larger, aligned buffer)
        self._bases: list[int] = []  # sorted
        self._pinned: dict[int, np.ndarray] = {}  # page-locked host memory (cudaMallocHost), the same way
        self._pinned_bases: list[int] = []
        self._streams: dict[int, list | None] = {}  # handle -> ops being captured (None: not capturing)
        self._invalidated: set[int] = set()
        self._graphs: dict[int, list] = {}
        self._execs: dict[int, list] = {}
        self._next_handle = 0x1000
        self.sticky: cudaError_t | None = None
        self.fault: str | None = None  # what the faulting kernel did, for the test's message
        self.mallocs = 0
        self.launches = 0
        self.log: list[str] = []  # every stream operation as it runs: ("memcpy2d", ...)

    # -- bookkeeping ---------------------------------------------------------------------------------
    def _handle(self, kind: str) -> Handle:
        self._next_handle += 0x10
        return Handle(kind, self._next_handle)

    def _block(self, ptr: int, pinned: bool = False) -> tuple[int, np.ndarray] | None:
        blocks, bases = (self._pinned, self._pinned_bases) if pinned else (self._blocks, self._bases)
        i = bisect.bisect_right(bases, ptr) - 1
        if i < 0:
            return None
        base = bases[i]
        block = blocks[base]
        return (base, block) if ptr < base + block.size else None

    def is_device(self, ptr: int) -> bool:
        return self._block(int(ptr)) is not None

    def is_pinned(self, ptr: int) -> bool:
        return self._block(int(ptr), pinned=True) is not None

    def device_bytes(self, ptr: int, nbytes: int, *, pinned: bool = False) -> np.ndarray:
        """The `nbytes` bytes at device address `ptr` (`pinned`: page-locked host address) as a uint8 view;
        _Fault unless all inside one live allocation."""
        ptr = int(ptr)
        found = self._block(ptr, pinned)
        if found is None:
            raise _Fault(f"address {ptr:#x} is in no allocation")
        base, block = found
        if ptr - base + nbytes > block.size:
            raise _Fault(f"{nbytes} bytes at {ptr:#x} run {ptr - base + nbytes - block.size} bytes past the end of "
                         f"the {block.size}-byte allocation at {base:#x}")
        return block[ptr - base: ptr - base + nbytes]

    def _extent_ok(self, ptr: int, nbytes: int, pinned: bool = False) -> bool:
        try:
            self.device_bytes(ptr, nbytes, pinned=pinned)
        except _Fault:
            return False
        return True

    def _spans(self, stream, spans: list[tuple[int, int]]) -> tuple[list, cudaError_t | None]:
        """The (address, bytes) extents a copy or memset touches, each checked: inside one device or page-locked
        allocation (else cudaErrorInvalidValue), or pageable host memory, which a capture on `stream` refuses
        (cudaErrorStreamCaptureUnsupported, the capture invalidated). Returns the extents to re-check when the
        operation runs, as (address, bytes, pinned)."""
        checked = []
        for ptr, nbytes in spans:
            for pinned in (False, True):
                if self._block(ptr, pinned) is not None:
                    if not self._extent_ok(ptr, nbytes, pinned):
                        return [], cudaError_t.cudaErrorInvalidValue
                    checked.append((ptr, nbytes, pinned))
                    break
            else:  # pageable
                s = int(stream)
                if self._streams.get(s) is not None:
                    self._invalidated.add(s)
                    return [], cudaError_t.cudaErrorStreamCaptureUnsupported
        return checked, None

    def _checked(self, spans: list, body):
        """`body`, run only when every extent still lies in a live allocation (a replay after a free faults)."""
        def op():
            for ptr, nbytes, pinned in spans:
                self.device_bytes(ptr, nbytes, pinned=pinned)
            body()

        return op

    def live(self) -> dict[str, int]:
        """What is still allocated: a test's leak check."""
        return {"allocations": len(self._blocks), "pinned": len(self._pinned), "streams": len(self._streams),
                "graphs": len(self._graphs), "graph_execs": len(self._execs)}

    def _capturing(self) -> list[int]:
        return [s for s, ops in self._streams.items() if ops is not None]

    def _submit(self, stream, op, what: str):
        """Run `op` now, or record it when `stream` is being captured."""
        s = int(stream)
        if s not in self._streams:
            return (cudaError_t.cudaErrorInvalidResourceHandle,)
        if self.sticky is not None:
            return (self.sticky,)
        if self._streams[s] is not None:
            self._streams[s].append((what, op))
            return OK
        self._run(what, op)
        return OK

    def _run(self, what: str, op):
        self.log.append(what)
        try:
            op()
        except _Fault as e:  # asynchronous: reported by the next call that synchronizes
            self.sticky, self.fault = cudaError_t.cudaErrorIllegalAddress, f"{what}: {e}"

    # -- the device ----------------------------------------------------------------------------------
    def cudaGetDevice(self):
        return cudaError_t.cudaSuccess, 0

    def cudaDeviceGetAttribute(self, attr, device):
        if int(device) != 0:
            return cudaError_t.cudaErrorInvalidDevice, 0
        major, minor = (int(x) for x in self.compute_capability.split("."))
        values = {cudaDeviceAttr.cudaDevAttrComputeCapabilityMajor: major,
                  cudaDeviceAttr.cudaDevAttrComputeCapabilityMinor: minor}
        if attr not in values:
            return cudaError_t.cudaErrorInvalidValue, 0
        return cudaError_t.cudaSuccess, values[attr]

    # -- memory --------------------------------------------------------------------------------------
    def _allocate(self, size, pinned: bool):
        if self._capturing():  # a "potentially unsafe" call in thread-local capture mode
            self._invalidated.update(self._capturing())
            return cudaError_t.cudaErrorStreamCaptureUnsupported, 0
        size = int(size)
        if size <= 0:
            return cudaError_t.cudaSuccess, 0  # the real call: success and a NULL pointer
        raw = np.empty(size + ALIGN, dtype=np.uint8)
        start = -raw.ctypes.data % ALIGN
        block = raw[start: start + size]
        block[:] = 0xFF  # NaN as float32/float16/bfloat16: reading memory nothing wrote shows up in the logits
        base = block.ctypes.data
        blocks, bases = (self._pinned, self._pinned_bases) if pinned else (self._blocks, self._bases)
        blocks[base] = block
        bisect.insort(bases, base)
        self.mallocs += not pinned
        return cudaError_t.cudaSuccess, base

    def _release(self, ptr, pinned: bool):
        ptr = int(ptr)
        if ptr == 0:
            return OK
        blocks, bases = (self._pinned, self._pinned_bases) if pinned else (self._blocks, self._bases)
        if ptr not in blocks:
            return (cudaError_t.cudaErrorInvalidValue,)
        del blocks[ptr]
        bases.remove(ptr)
        return OK

    def cudaMalloc(self, size):
        return self._allocate(size, pinned=False)

    def cudaFree(self, devPtr):
        return self._release(devPtr, pinned=False)

    def cudaMallocHost(self, size):
        """Page-locked host memory: the host memory a captured copy may use."""
        return self._allocate(size, pinned=True)

    def cudaFreeHost(self, ptr):
        return self._release(ptr, pinned=True)

    def _check_kind(self, dst: int, src: int, kind) -> cudaError_t | None:
        kind = cudaMemcpyKind(kind)
        want = {cudaMemcpyKind.cudaMemcpyHostToDevice: (True, False),
                cudaMemcpyKind.cudaMemcpyDeviceToHost: (False, True),
                cudaMemcpyKind.cudaMemcpyDeviceToDevice: (True, True),
                cudaMemcpyKind.cudaMemcpyHostToHost: (False, False)}.get(kind)
        if want is None:
            return None  # cudaMemcpyDefault: inferred from the pointers
        if (self.is_device(dst), self.is_device(src)) != want:
            return cudaError_t.cudaErrorInvalidMemcpyDirection
        return None

    def cudaMemcpyAsync(self, dst, src, count, kind, stream):
        dst, src, count = int(dst), int(src), int(count)
        err = self._check_kind(dst, src, kind)
        if err is not None:
            return (err,)
        spans, err = self._spans(stream, [(dst, count), (src, count)])
        if err is not None:
            return (err,)
        return self._submit(stream, self._checked(spans, lambda: ctypes.memmove(dst, src, count)), f"memcpy {count}B")

    def cudaMemcpy2DAsync(self, dst, dpitch, src, spitch, width, height, kind, stream):
        dst, dpitch, src, spitch, width, height = map(int, (dst, dpitch, src, spitch, width, height))
        if width > dpitch or width > spitch:  # "width must not exceed either dpitch or spitch"
            return (cudaError_t.cudaErrorInvalidPitchValue,)
        err = self._check_kind(dst, src, kind)
        if err is not None:
            return (err,)
        if width == 0 or height == 0:
            return self._submit(stream, lambda: None, "memcpy2d (empty)")
        spans, err = self._spans(stream, [(dst, (height - 1) * dpitch + width), (src, (height - 1) * spitch + width)])
        if err is not None:
            return (err,)

        def op():
            for r in range(height):
                ctypes.memmove(dst + r * dpitch, src + r * spitch, width)

        return self._submit(stream, self._checked(spans, op), f"memcpy2d {height}x{width}B")

    def cudaMemsetAsync(self, devPtr, value, count, stream):
        ptr, value, count = int(devPtr), int(value), int(count)
        if not self._extent_ok(ptr, count):
            return (cudaError_t.cudaErrorInvalidValue,)
        op = self._checked([(ptr, count, False)], lambda: ctypes.memset(ptr, value, count))
        return self._submit(stream, op, f"memset {count}B")

    def launch_kernel(self, stream, op, what: str):
        """How the TensorRT stand-in enqueues its work (a kernel launch on `stream`)."""
        return self._submit(stream, op, what)

    # -- streams and graphs --------------------------------------------------------------------------
    def cudaStreamCreateWithFlags(self, flags):
        h = self._handle("cudaStream_t")
        self._streams[int(h)] = None
        return cudaError_t.cudaSuccess, h

    def cudaStreamDestroy(self, stream):
        if self._streams.pop(int(stream), 0) == 0:
            return (cudaError_t.cudaErrorInvalidResourceHandle,)
        return OK

    def cudaStreamSynchronize(self, stream):
        s = int(stream)
        if s not in self._streams:
            return (cudaError_t.cudaErrorInvalidResourceHandle,)
        if self._streams[s] is not None:  # illegal while capturing; it breaks the capture
            self._invalidated.add(s)
            return (cudaError_t.cudaErrorStreamCaptureUnsupported,)
        return (self.sticky,) if self.sticky is not None else OK

    def cudaStreamBeginCapture(self, stream, mode):
        s = int(stream)
        if s not in self._streams:
            return (cudaError_t.cudaErrorInvalidResourceHandle,)
        if self._streams[s] is not None:
            return (cudaError_t.cudaErrorIllegalState,)
        cudaStreamCaptureMode(mode)
        self._streams[s] = []
        return OK

    def cudaStreamEndCapture(self, stream):
        s = int(stream)
        if self._streams.get(s) is None:
            return cudaError_t.cudaErrorIllegalState, None
        ops, self._streams[s] = self._streams[s], None
        if s in self._invalidated:
            self._invalidated.discard(s)
            return cudaError_t.cudaErrorStreamCaptureInvalidated, None
        g = self._handle("cudaGraph_t")
        self._graphs[int(g)] = ops
        return cudaError_t.cudaSuccess, g

    def cudaGraphInstantiate(self, graph, flags):
        if graph is None or int(graph) not in self._graphs:
            return cudaError_t.cudaErrorInvalidValue, None
        e = self._handle("cudaGraphExec_t")
        self._execs[int(e)] = list(self._graphs[int(graph)])
        return cudaError_t.cudaSuccess, e

    def cudaGraphLaunch(self, graphExec, stream):
        if graphExec is None or int(graphExec) not in self._execs:
            return (cudaError_t.cudaErrorInvalidValue,)
        ops = self._execs[int(graphExec)]

        def replay():
            for what, op in ops:
                self._run(what, op)

        self.launches += 1
        return self._submit(stream, replay, "graph launch")

    def cudaGraphDestroy(self, graph):
        if graph is None or self._graphs.pop(int(graph), None) is None:
            return (cudaError_t.cudaErrorInvalidValue,)
        return OK

    def cudaGraphExecDestroy(self, graphExec):
        if graphExec is None or self._execs.pop(int(graphExec), None) is None:
            return (cudaError_t.cudaErrorInvalidValue,)
        return OK

    def cudaGetLastError(self):
        return (self.sticky,) if self.sticky is not None else OK

    def graph_ops(self, graph_exec) -> list[str]:
        """What an instantiated graph replays, in order (for tests)."""
        return [what for what, _ in self._execs[int(graph_exec)]]


# ---------------------------------------------------------------------------------------------------------
# TensorRT
# ---------------------------------------------------------------------------------------------------------

class TensorIOMode(enum.IntEnum):
    NONE = 0
    INPUT = 1
    OUTPUT = 2


def _bf16():
    import ml_dtypes  # numpy has no bfloat16; onnx depends on ml_dtypes

    return ml_dtypes.bfloat16


def numpy_dtype(dt: DataType):
    return {DataType.FLOAT: np.dtype(np.float32), DataType.HALF: np.dtype(np.float16), DataType.INT32: np.dtype(np.int32),
            DataType.INT64: np.dtype(np.int64), DataType.BF16: np.dtype(_bf16())}[dt]


def kernel_error_model(model, storage: str):
    """`model` (an onnx.ModelProto with plugin calls) with every call inlined as the plugin kernel computes it
    for `storage` ("float32" / "float16" / "bfloat16"): x (+ bias) in float32, u = sqrt(2/pi) x (1 + 0.044715 x^2),
    t = tanh(u) (1 + TANH_REL_ERR[storage]) (every element off by the whole bound, the same way: the worst the
    kernel's documented error allows), y = x/2 + x/2 t, rounded once to the storage. A GPU's error is spread
    in sign; this one adds up, so an engine that passes here passes there."""
    import onnx
    import onnx.inliner
    from onnx import TensorProto, helper

    from andrea_export.plugin import GELU_BIAS_OP, PLUGIN_NAMESPACE
    from andrea_export.plugin.reference import CUBIC, SQRT_2_OVER_PI, TANH_REL_ERR

    def const(name: str, value: float):
        return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.FLOAT, [], [value]))

    out = onnx.ModelProto()
    out.CopyFrom(model)
    for i, f in enumerate(out.functions):
        if f.domain != PLUGIN_NAMESPACE:
            continue
        with_bias = f.name == GELU_BIAS_OP
        inputs = ["x", "bias"] if with_bias else ["x"]
        nodes = [helper.make_node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT)]
        if with_bias:
            nodes += [helper.make_node("Cast", ["bias"], ["bf"], to=TensorProto.FLOAT),
                      helper.make_node("Add", ["xf", "bf"], ["v"])]  # the kernel adds in float32
        v = "v" if with_bias else "xf"
        nodes += [const("c0", SQRT_2_OVER_PI), const("c1", CUBIC * SQRT_2_OVER_PI), const("half", 0.5),
                  const("err", 1.0 + TANH_REL_ERR[storage]),
                  helper.make_node("Mul", [v, v], ["v2"]), helper.make_node("Mul", ["c1", "v2"], ["c1v2"]),
                  helper.make_node("Add", ["c1v2", "c0"], ["poly"]), helper.make_node("Mul", [v, "poly"], ["u"]),
                  helper.make_node("Tanh", ["u"], ["t_exact"]), helper.make_node("Mul", ["t_exact", "err"], ["t"]),
                  helper.make_node("Mul", ["half", v], ["hx"]), helper.make_node("Mul", ["hx", "t"], ["hxt"]),
                  helper.make_node("Add", ["hxt", "hx"], ["yf"]),
                  helper.make_node("CastLike", ["yf", "x"], ["y"])]  # fmt: skip
        body = helper.make_function(f.domain, f.name, inputs, ["y"], nodes, [helper.make_opsetid("", 20)])
        out.functions[i].CopyFrom(body)
    return onnx.inliner.inline_local_functions(out)


def plugin_storage(model) -> str | None:
    """The storage dtype of the graph's plugin calls ("float32" / "float16" / "bfloat16"), None without any."""
    import onnx
    from onnx import TensorProto

    from andrea_export.plugin import PLUGIN_NAMESPACE

    calls = [n for n in model.graph.node if n.domain == PLUGIN_NAMESPACE]
    if not calls:
        return None
    typed = onnx.shape_inference.infer_shapes(model, strict_mode=False).graph
    types = {v.name: v.type.tensor_type.elem_type for v in list(typed.value_info) + list(typed.input)}
    kinds = {types.get(n.input[0]) for n in calls}
    names = {TensorProto.FLOAT: "float32", TensorProto.FLOAT16: "float16", TensorProto.BFLOAT16: "bfloat16"}
    if len(kinds) != 1 or next(iter(kinds)) not in names:
        raise ValueError(f"plugin calls on {kinds}: one storage dtype of {list(names.values())} expected")
    return names[kinds.pop()]


def graph_plugins(onnx_path: str | Path) -> list[dict]:
    """The plugin creators an engine built from `onnx_path` by this project's TensorRT build uses: one per plugin op
    of the graph, AOT (register.py registers only `aot_impl`s, so the builder embeds the kernel)."""
    import onnx

    from andrea_export.plugin import PLUGIN_NAMESPACE, PLUGIN_VERSION

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    ops = sorted({n.op_type for n in graph.node if n.domain == PLUGIN_NAMESPACE})
    return [{"name": op, "namespace": PLUGIN_NAMESPACE, "version": PLUGIN_VERSION, "aot": True} for op in ops]


def write_plan(path: str | Path, onnx_path: str | Path, profiles: list[dict], *, fail_capture: bool = False,
               trt_version: str = TRT_VERSION, compute_capability: str = COMPUTE_CAPABILITY,
               hardware_compatibility: str = "NONE", plugins: list[dict] | None = None) -> Path:
    """A fake engine file: the graph it was "built" from and its optimization profiles. `fail_capture`:
    its enqueue fails while a stream is being captured (an engine that cannot be captured). Where it may load:
    the TensorRT that built it, the compute capability it was built for and its hardware-compatibility level, and
    the plugin creators of its plugin layers ({"name", "namespace", "version", "aot"}; default: the graph's
    plugin calls, AOT, as this project builds them)."""
    assert hardware_compatibility in HARDWARE_COMPATIBILITY, hardware_compatibility
    _refuse_slot_build(onnx_path, trt_version)
    path = Path(path)
    plugins = graph_plugins(onnx_path) if plugins is None else plugins
    path.write_text(json.dumps({"fake_engine": str(onnx_path), "profiles": profiles, "fail_capture": fail_capture,
                                "trt_version": trt_version, "compute_capability": compute_capability,
                                "hardware_compatibility": hardware_compatibility, "plugins": plugins}))
    return path


KV_CACHE_UPDATE_SINCE = (10, 15)  # TensorRT's IKVCacheUpdateLayer, and its parser's TensorScatter importer
ATTENTION_IGNORED = {4: "past_key", 5: "past_value", 6: "nonpad_kv_seqlen"}  # Attention-24's inputs by index


def _version(text: str) -> tuple[int, int]:
    return tuple(int(x) for x in text.split(".")[:2])  # type: ignore[return-value]


def _refuse_slot_build(onnx_path, trt_version: str) -> None:
    """What TensorRT's parser and builder would not build as this graph says, raised (a plan of it cannot exist)."""
    import onnx

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    for n in graph.node:
        if n.op_type == "TensorScatter" and _version(trt_version) < KV_CACHE_UPDATE_SINCE:
            raise ValueError(f"TensorRT {trt_version} has no KV-cache-update layer for '{n.name}' (10.15 on)")
        if n.op_type == "Attention":
            given = [name for i, name in ATTENTION_IGNORED.items() if len(n.input) > i and n.input[i]]
            if given or any(n.output[1:]):
                raise ValueError(f"'{n.name}': TensorRT ignores or refuses {given or 'present/qk outputs'}")


def _slot_probes(model) -> tuple[dict[str, str], list[tuple[str, str, str]], list[tuple[str, str]]]:
    """A slot graph's KV-cache updates, as ({present output: past input}, [(present, update, write index)]), and its
    is_causal Attentions' (query, key) tensors: what the engine reports and what its enqueue checks."""
    inputs, outputs = {v.name for v in model.graph.input}, {v.name for v in model.graph.output}
    aliases, writes, causal = {}, [], []
    for n in model.graph.node:
        if n.op_type == "TensorScatter" and n.input[0] in inputs and n.output[0] in outputs:
            aliases[n.output[0]] = n.input[0]
            writes.append((n.output[0], n.input[1], n.input[2]))
        if n.op_type == "Attention" and any(a.name == "is_causal" and a.i for a in n.attribute):
            causal.append((n.input[0], n.input[1]))
    return aliases, writes, causal


def _binding_change(shapes: dict, addresses: dict, now_shapes: dict, now_addresses: dict) -> str:
    """What differs between a context's bindings at capture and now, named."""
    changed = [f"'{n}' shape {list(shapes.get(n, ()))} -> {list(now_shapes.get(n, ()))}" for n in
               sorted(set(shapes) | set(now_shapes)) if shapes.get(n) != now_shapes.get(n)]
    changed += [f"'{n}' address moved" for n in sorted(set(addresses) | set(now_addresses))
                if addresses.get(n) != now_addresses.get(n)]
    return ", ".join(changed[:3]) + (", ..." if len(changed) > 3 else "")


def fake_tensorrt(cudart: FakeCudart, *, version: str = TRT_VERSION,
                  plugin_creators: tuple[tuple[str, str, str], ...] = ()) -> types.SimpleNamespace:
    """A `tensorrt` module stand-in whose engines run on `cudart`'s memory and streams, on its GPU. `version`: the
    TensorRT installed; `plugin_creators`: what this process registered, as (name, version, namespace) (default:
    nothing, a fresh process)."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto

    from andrea_export.graphs.precision import emulate_in_fp32

    onnx_to_trt = {TensorProto.FLOAT: DataType.FLOAT, TensorProto.FLOAT16: DataType.HALF,
                   TensorProto.BFLOAT16: DataType.BF16, TensorProto.INT64: DataType.INT64, TensorProto.INT32: DataType.INT32}

    class Engine:
        def __init__(self, spec: dict, logger):
            self.logger = logger  # the Runtime's: TensorRT reports an enqueue's API errors through it
            model = onnx.load(spec["fake_engine"])
            self.profiles = spec["profiles"]
            self.fail_capture = spec.get("fail_capture", False)
            self.inputs = [v.name for v in model.graph.input]
            self.outputs = [v.name for v in model.graph.output]
            self._dtype, self._shape = {}, {}
            for v in list(model.graph.input) + list(model.graph.output):
                tt = v.type.tensor_type
                self._dtype[v.name] = onnx_to_trt[tt.elem_type]
                self._shape[v.name] = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tt.shape.dim)
            self.bf16 = DataType.BF16 in self._dtype.values()
            if storage := plugin_storage(model):  # what TensorRT builds a plugin call into: the kernel, with its error
                model = kernel_error_model(model, storage)
            runnable = emulate_in_fp32(model) if self.bf16 else model  # ORT's CPU provider has no bf16 kernels
            self.aliases, self.writes, self.causal = _slot_probes(model)
            # the write indices and updates, and is_causal's query and key, read back beside the outputs: checked
            self.probes = sorted({t for _, update, index in self.writes for t in (update, index)}
                                 | {t for pair in self.causal for t in pair})
            runnable.graph.output.extend(onnx.ValueInfoProto(name=t) for t in self.probes)
            options = ort.SessionOptions()
            options.log_severity_level = 3  # TensorScatter's "copying past_cache": fed copies, it cannot write in place
            self.ort = ort.InferenceSession(runnable.SerializeToString(), options, providers=["CPUExecutionProvider"])
            self.num_io_tensors = len(self.inputs) + len(self.outputs)
            self.num_optimization_profiles = len(self.profiles)

        def get_tensor_name(self, index):
            return (self.inputs + self.outputs)[index]

        def get_tensor_dtype(self, name):
            return self._dtype[name]

        def get_tensor_mode(self, name):
            return TensorIOMode.INPUT if name in self.inputs else TensorIOMode.OUTPUT if name in self.outputs else TensorIOMode.NONE

        def get_tensor_shape(self, name):
            return self._shape[name]

        def get_tensor_profile_shape(self, name, profile_index):
            s = self.profiles[profile_index]["shapes"][name]
            return [tuple(s["min"]), tuple(s["opt"]), tuple(s["max"])]

        def create_execution_context(self):
            return Context(self)

        if _version(version) >= KV_CACHE_UPDATE_SINCE:
            def get_aliased_input_tensor(self, name):
                """The input `name` (an output) must share its address with, or None (ICudaEngine, 10.15)."""
                return self.aliases.get(name)

    class Context:
        def __init__(self, engine: Engine):
            self.engine, self.profile, self.shapes, self.addresses = engine, 0, {}, {}

        def set_optimization_profile_async(self, profile_index, stream_handle):
            if not 0 <= profile_index < self.engine.num_optimization_profiles or int(stream_handle) not in cudart._streams:
                return False
            self.profile, self.shapes = profile_index, {}
            return True

        def set_input_shape(self, name, shape):
            e = self.engine
            if name not in e.inputs:
                return False
            lo, _, hi = e.get_tensor_profile_shape(name, self.profile)
            shape = tuple(int(x) for x in shape)
            if len(shape) != len(lo) or not all(a <= x <= b for a, x, b in zip(lo, shape, hi)):
                return False
            self.shapes[name] = shape
            return True

        def set_tensor_address(self, name, memory):
            e = self.engine
            if e.get_tensor_mode(name) == TensorIOMode.NONE:
                return False
            # NvInferRuntime.h, IExecutionContext::setTensorAddress: "The pointer must have at least 256-byte
            # alignment." (element alignment is not enough: a pointer into a buffer's middle is refused)
            if int(memory) % ALIGN:
                return False
            self.addresses[name] = int(memory)
            return True

        def execute_async_v3(self, stream_handle):
            e = self.engine
            if int(stream_handle) not in cudart._streams:
                return False
            if set(self.shapes) != set(e.inputs) or set(self.addresses) != set(e.inputs + e.outputs):
                return False  # TensorRT: "not all shapes are specified" / "address is not set"
            if e.fail_capture and cudart._streams[int(stream_handle)] is not None:
                return False
            for present, past in e.aliases.items():
                if self.addresses[present] != self.addresses[past]:
                    e.logger.log(Logger.ERROR, f"3: [executionContext.cpp] '{present}' and its KV-cache input '{past}' "
                                               "are bound to different addresses")  # "TensorRT reports an API error"
                    return False
            shapes, addresses = dict(self.shapes), dict(self.addresses)  # baked into the enqueued work

            def tensor(name: str, nbytes: int) -> np.ndarray:
                try:
                    return cudart.device_bytes(addresses[name], nbytes)
                except _Fault as err:
                    raise _Fault(f"tensor '{name}': {err}") from None

            def kernel():
                feed = {}
                for name in e.inputs:
                    dt = numpy_dtype(e.get_tensor_dtype(name))
                    a = tensor(name, int(np.prod(shapes[name])) * dt.itemsize).view(dt).reshape(shapes[name])
                    feed[name] = a.astype(np.float32) if dt == np.dtype(_bf16()) else a.copy()
                try:
                    results = e.ort.run(e.outputs + e.probes, feed)
                except Exception as err:  # ONNX Runtime refuses the out-of-range write that TensorRT would drop
                    if "TensorScatter" not in str(err):
                        raise
                    raise _Fault(f"past the cache's end: TensorRT would drop the write silently ({err})") from None
                probe = dict(zip(e.probes, results[len(e.outputs):]))
                for present, update, index in e.writes:
                    length, end = probe[update].shape[2], shapes[e.aliases[present]][2]
                    if (probe[index] + length > end).any():  # TensorRT drops these writes silently
                        raise _Fault(f"'{present}': rows written from {probe[index].tolist()}, {length} tokens each, "
                                     f"past the cache's end ({end}): TensorRT would drop them silently")
                for query, key in e.causal:
                    if probe[query].shape[-2] != probe[key].shape[-2]:
                        raise _Fault(f"is_causal Attention with {probe[query].shape[-2]} queries and "
                                     f"{probe[key].shape[-2]} keys: TensorRT's upper-left mask is not ONNX's")
                written: dict[int, str] = {}  # the address of each (cache row, position) an update writes -> who
                for name, out in zip(e.outputs, results):
                    out = np.ascontiguousarray(out.astype(numpy_dtype(e.get_tensor_dtype(name))))
                    if name in e.aliases:
                        in_place(name, out, probe, written)
                    else:
                        tensor(name, out.nbytes)[...] = out.reshape(-1).view(np.uint8)

            def in_place(name: str, out: np.ndarray, probe: dict, written: dict) -> None:
                """A KV-cache update writes only its new positions, where its cache lies (an in-place layer:
                the rest of the cache is not copied back). Two updates of one enqueue that write the same
                position of one cache row race on a GPU (their order is TensorRT's): that faults here."""
                update, index = next((u, i) for p, u, i in e.writes if p == name)
                length, rows, H, C, D = probe[update].shape[2], *out.shape
                base, item = addresses[name], out.itemsize
                cache = tensor(name, out.nbytes).view(out.dtype).reshape(out.shape)
                for b in range(rows):
                    for p in range(int(probe[index][b]), int(probe[index][b]) + length):
                        key = base + ((b * H * C) + p) * D * item
                        if key in written:
                            raise _Fault(f"'{name}' and '{written[key]}' both write position {p} of one cache row in "
                                         "one enqueue: the result depends on which of the two runs last")
                        written[key] = name
                        cache[b, :, p, :] = out[b, :, p, :]

            work = kernel
            if cudart._streams[int(stream_handle)] is not None:  # captured: a replay runs with these bindings baked in
                def work():
                    if (self.shapes, self.addresses) != (shapes, addresses):
                        raise _Fault(f"a captured enqueue replayed while its context is bound to other shapes or "
                                     f"addresses ({_binding_change(shapes, addresses, self.shapes, self.addresses)}): "
                                     "bind the context as it was at capture before each replay")
                    kernel()

            return cudart.launch_kernel(stream_handle, work, f"enqueue profile {self.profile}")[0] == cudaError_t.cudaSuccess

    class Logger:
        """trt.Logger: prints what reaches its severity to stderr ("[TRT] [E] ..."), and keeps every message."""

        INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = 0, 1, 2, 3, 4

        def __init__(self, min_severity=WARNING):
            self.min_severity = min_severity
            self.messages: list[tuple[int, str]] = []

        def log(self, severity, msg):
            self.messages.append((severity, msg))
            if severity <= self.min_severity:
                print(f"[TRT] [{'EEWIV'[severity]}] {msg}", file=sys.stderr)

    class PluginRegistry:
        """The process's plugin registry: which creators are registered, looked up by (name, version, namespace)."""

        def __init__(self, creators):
            self.creators = {tuple(c) for c in creators}

        def get_creator(self, name, version, plugin_namespace=""):
            key = (name, version, plugin_namespace)
            return key if key in self.creators else None

    registry = PluginRegistry(plugin_creators)

    def compatible(built_for: str, level: str) -> bool:
        gpu = tuple(int(x) for x in cudart.compute_capability.split("."))
        if level == "AMPERE_PLUS":
            return gpu >= (8, 0)
        return gpu == tuple(int(x) for x in built_for.split("."))  # NONE, SAME_COMPUTE_CAPABILITY

    def refusal(spec: dict) -> list[str]:
        """Why TensorRT would not deserialize this plan here, in its log's words ([] when it loads), checked in
        its order: the header (version), the device, then each plugin layer's creator."""
        if spec.get("trt_version") != version:
            return [(f"6: The engine plan file is not compatible with this version of TensorRT, expecting library "
                     f"version {version} got {spec.get('trt_version')}, please rebuild.")]
        if not compatible(spec["compute_capability"], spec["hardware_compatibility"]):
            return [(f"6: The engine plan file is generated on an incompatible device, expecting compute "
                     f"{cudart.compute_capability} got compute {spec['compute_capability']}, please rebuild.")]
        for p in spec["plugins"]:
            if not p["aot"] and registry.get_creator(p["name"], p["version"], p["namespace"]) is None:
                return [f"getCreator could not find plugin {p['name']} version {p['version']} namespace {p['namespace']}",
                        ("1: Serialization (Serialization assertion creator failed.Cannot deserialize plugin since "
                         "corresponding IPluginCreator not found in Plugin Registry)")]
        return []

    class Runtime:
        def __init__(self, logger):
            self.logger = logger

        def deserialize_cuda_engine(self, serialized_engine):
            """An Engine, or None with the reason in the log, as TensorRT does."""
            try:
                spec = json.loads(bytes(serialized_engine))
                why = refusal(spec)
            except (ValueError, KeyError, TypeError, AttributeError):
                why = [("1: Serialization (Serialization assertion magicTagRead == kMAGIC_TAG failed.Magic tag does "
                        "not match)")]
            if why:
                for line in why + ["4: Internal Error (Engine deserialization failed.)"]:
                    self.logger.log(Logger.ERROR, line)
                return None
            return Engine(spec, self.logger)

    return types.SimpleNamespace(
        __name__="tensorrt", __version__=version, get_plugin_registry=lambda: registry,
        Runtime=Runtime, Logger=Logger, DataType=DataType, TensorIOMode=TensorIOMode,
        float32=DataType.FLOAT, float16=DataType.HALF, bfloat16=DataType.BF16, int8=DataType.INT8,
        int32=DataType.INT32, int64=DataType.INT64, bool=DataType.BOOL, uint8=DataType.UINT8,
    )

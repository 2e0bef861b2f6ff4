"""OpenVINO backend: the build's standard KV-cache decoder graph (`decoder.onnx`) read by OpenVINO's ONNX
frontend and made stateful, on the CPU plugin.

Why a second CPU runtime: on CPUs with bf16 instructions (AVX512-BF16, AMX) OpenVINO computes in bf16
by default (`INFERENCE_PRECISION_HINT`), which ONNX Runtime's CPU provider cannot do (it has no bf16
kernels on x86). The weights stay the build's fp32 ones; the matmuls round their inputs to bf16 and
accumulate in fp32. `inference_precision="f32"` keeps OpenVINO in full precision, cache included, and so
does a CPU without bf16 instructions: there OpenVINO computes in f32, and the session is then an f32
session throughout (the u8 cache would be the only lossy step of an otherwise full-precision run).

Stateful: `apply_make_stateful_transformation` (what optimum-intel applies to its own exports) turns every
`past_key_values.*` input / `present.*` output pair into one internal state, so the cache stays inside the
infer request between steps (no copy in, none out); only the ids, the mask and the logits cross. Each
state starts as an empty cache for the call's batch ([B, n_head, 0, head_dim], its batch read from the
ids: the graph derives the batch from the past, so OpenVINO's default empty state would not do).

Attention (`fuse_attention`): read as it is, the graph's attention stays MatMul, Select, Softmax, MatMul,
and every step copies the whole past into a longer present (Concat). Each layer's attention is handed to
OpenVINO's ScaledDotProductAttention instead, its past read through an identity Gather along the batch
(the form of optimum-intel's exports, whose beam index reorders the cache; ours is 0..B-1), so that the CPU
plugin fuses cache, concatenation and attention into one node (ScaledDotProductAttentionWithKVCache) that
appends each step's keys and values in place. The cache is then kept at the plugin's KV_CACHE_PRECISION:
u8 by default on x86 (per token and head, with a scale and zero point), f16, bf16 or f32 when asked
(`kv_cache_precision`). ANDREA-120M, greedy 32 + 128 tokens, 2 cores: see docs/benchmarks.md.

Each call gets its own infer request, its states reset. One compiled model serves many threads: infer
requests are independent (OpenVINO's threading rule), and `infer` releases the GIL while it runs.

The graph derives positions from the mask, so left-padded batches are right here as in ONNX Runtime.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import numpy as np

from ..config import ModelConfig
from ..errors import InputError, require
from ..graphs.layout import KVLayout
from ..names import ATTENTION_MASK, INPUT_IDS
from .base import Session, Steps

PRECISIONS = ("default", "bf16", "f32")  # "default": OpenVINO's choice for this CPU (bf16 where it has bf16)
KV_CACHE_PRECISIONS = ("default", "u8", "f16", "bf16", "f32")  # "default": the CPU plugin's (u8 on x86)


def cpu_config(threads: int | None = None, precision: str = "default", kv_cache_precision: str = "default") -> dict:
    """The CPU plugin's settings for every OpenVINO model of ours (runtime, verification, benchmark): one
    stream, latency; `threads` INFERENCE_NUM_THREADS (None: OpenVINO's choice); `precision` "bf16" / "f32"
    as INFERENCE_PRECISION_HINT, `kv_cache_precision` "u8" / "f16" / "bf16" / "f32" as KV_CACHE_PRECISION (which
    applies to a fused attention's cache only; "default": OpenVINO's choice)."""
    config = {"PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": "1"}
    if precision != "default":
        config["INFERENCE_PRECISION_HINT"] = precision
    if kv_cache_precision != "default":
        config["KV_CACHE_PRECISION"] = kv_cache_precision
    if threads:
        config["INFERENCE_NUM_THREADS"] = str(threads)
    return config


def compute_precision(compiled) -> str:
    """What a compiled model computes in, as OpenVINO reports it: "bf16" or "f32"."""
    return compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()


def kv_cache_precision_of(compiled) -> str | None:
    """The precision a compiled model keeps a fused attention's cache in ("u8", "f16", "bf16", "f32"), as OpenVINO
    reports it; None when no attention was fused (the cache is then the graph's own tensors)."""
    ops = compiled.get_runtime_model().get_ordered_ops()
    if not any(op.get_rt_info()["layerType"].astype(str) == "ScaledDotProductAttention" for op in ops):
        return None
    return compiled.get_property("KV_CACHE_PRECISION").get_type_name()


def check_name(inference_precision: str) -> str:
    """The build's check of this backend computing in `inference_precision` (verify.json "runtimes", the manifest)."""
    return f"openvino-{inference_precision}"


@functools.cache
def core():
    """The process's one OpenVINO Core, which every session and check compiles with. One, kept: each Core's CPU
    plugin points the main thread's signal stack (sigaltstack) at memory of its own and, when that Core goes,
    back at the one it found, so Cores that go in the order they came leave it on freed memory, and the next
    signal Python handles (Ctrl-C, SIGTERM, an alarm) crashes the process (OpenVINO 2026.4)."""
    ov = require("openvino", "openvino", "the OpenVINO backend")
    return ov.Core()


def cpu_has_bf16() -> bool:
    """Whether OpenVINO's CPU plugin reports bf16 among this CPU's optimization capabilities."""
    return "BF16" in core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")


def fuse_attention(model, layout: KVLayout) -> bool:
    """Rewrite every layer's attention of the standard decoder, as OpenVINO's ONNX frontend reads it
    (MatMul(q, Transpose(Concat(past_k, k))) * scale, Select(not allowed, -inf, .), Softmax, MatMul(.,
    Concat(past_v, v))), as ScaledDotProductAttention(q, keys, values, Select(allowed, 0, -inf), scale), each
    past read through Gather(past, 0..B-1, axis 0) (see the module docstring). Before make-stateful. All
    layers or none: False (the graph untouched) where any layer's attention is not of that form."""
    import openvino.opset13 as ops

    found = []
    for softmax in (n for n in model.get_ordered_ops() if n.get_type_name() == "Softmax"):
        match = _attention(softmax, set(layout.past_names))
        if match is None:
            return False
        found.append(match)
    if len(found) != layout.n_layer:
        return False
    rows = ops.range(ops.constant(np.int32(0)), _batch(model, np.int32), ops.constant(np.int32(1)), "i32")  # identity
    for q, keys, values, allowed, fill, scale, out in found:
        for concat in (keys.get_node(), values.get_node()):
            past = concat.input_value(0)
            concat.input(0).replace_source_output(ops.gather(past, rows, ops.constant(np.int32(0))).output(0))
        bias = ops.select(allowed, ops.constant(np.float32(0)), fill)
        sdpa = ops.scaled_dot_product_attention(q, keys, values, bias, scale, causal=False)
        out.output(0).replace(sdpa.output(0))
    model.validate_nodes_and_infer_types()
    return True


def _attention(softmax, past_names: set[str]):
    """(q, keys, values, allowed, fill, scale, the output MatMul) of one layer's attention around `softmax`,
    or None where the graph is not of the form fuse_attention knows."""

    def node(output, kind):
        n = output.get_node()
        return n if n.get_type_name() == kind else None

    def past_concat(output):  # Concat(past parameter, this step's) along the sequence axis
        concat = node(output, "Concat")
        if concat is None or concat.get_input_size() != 2 or concat.get_attributes()["axis"] not in (2, -2):
            return None
        first = concat.input_value(0).get_node()
        return concat if first.get_type_name() == "Parameter" and first.get_friendly_name() in past_names else None

    select = node(softmax.input_value(0), "Select")
    negated = select and node(select.input_value(0), "LogicalNot")
    scaled = select and node(select.input_value(2), "Multiply")
    scores = scaled and node(scaled.input_value(0), "MatMul")
    transposed = scores and node(scores.input_value(1), "Transpose")
    consumers = list(softmax.output(0).get_target_inputs())
    if not (negated and scaled and scores and transposed and len(consumers) == 1) or consumers[0].get_index() != 0:
        return None
    out = consumers[0].get_node()
    scale, fill = scaled.input_value(1), select.input_value(1)
    order = node(transposed.input_value(1), "Constant")
    if (out.get_type_name() != "MatMul" or any(m.get_attributes()["transpose_a"] or m.get_attributes()["transpose_b"]
                                              for m in (scores, out))
            or scale.get_node().get_type_name() != "Constant" or fill.get_node().get_type_name() != "Constant"
            or order is None or list(order.get_data()) != [0, 1, 3, 2]):
        return None
    keys, values = transposed.input_value(0), out.input_value(1)
    if past_concat(keys) is None or past_concat(values) is None:
        return None
    return scores.input_value(0), keys, values, negated.input_value(0), fill, scale, out


def _batch(model, dtype):
    """The ids' batch size, a scalar of `dtype` computed in the graph (from the shape of input_ids)."""
    import openvino.opset13 as ops

    name = np.dtype(dtype).name.replace("int", "i")
    return ops.gather(ops.shape_of(model.input(INPUT_IDS), name), ops.constant(dtype(0)), ops.constant(dtype(0)))


def _empty_cache_on_reset(model, layout: KVLayout) -> None:
    """Every state (after make-stateful) starts as [B, n_head, 0, head_dim] zeros, B the ids' batch."""
    import openvino.opset13 as ops

    batch = ops.unsqueeze(_batch(model, np.int64), ops.constant(np.int64(0)))
    rest = ops.constant(np.array([layout.n_head, 0, layout.head_dim], dtype=np.int64))
    for op in model.get_ops():
        if op.get_type_name() == "ReadValue":
            zero = ops.constant(np.zeros((), dtype=op.get_output_element_type(0).to_dtype()))
            op.set_arguments([ops.broadcast(zero, ops.concat([batch, rest], 0))])
    model.validate_nodes_and_infer_types()


class OpenVinoSession(Session):
    backend = "openvino"

    def __init__(self, onnx_path: str | Path, cfg: ModelConfig, layout: KVLayout, *, inference_precision: str = "default",
                 threads: int | None = None, kv_cache_precision: str = "default", fuse: bool = True):  # fmt: skip
        """`inference_precision`: "default" (OpenVINO's: bf16 on a CPU with bf16 instructions, else f32), "bf16"
        (refused on a CPU without them: OpenVINO would emulate it slowly) or "f32". `threads`: the CPU
        plugin's INFERENCE_NUM_THREADS (default: OpenVINO's choice). `kv_cache_precision`: "default" (the
        CPU plugin's, u8 on x86; f32 wherever the session computes in f32), "u8", "f16", "bf16" or "f32". `fuse`: hand
        attention and its cache to OpenVINO's fused kernel (fuse_attention; False: the graph's own ops and
        Concat cache, for comparison)."""
        require("openvino", "openvino", "the OpenVINO backend")  # before its submodule: the install hint
        from openvino._offline_transformations import apply_make_stateful_transformation

        super().__init__(cfg, layout, str(onnx_path))
        if layout.shared:
            raise InputError(f"{onnx_path}: the OpenVINO backend reads the standard decoder (decoder.onnx), not the "
                             "in-place one (its GroupQueryAttention is an ONNX Runtime operator)")  # fmt: skip
        if inference_precision not in PRECISIONS:
            raise InputError(f"inference_precision must be one of {', '.join(PRECISIONS)}, not {inference_precision!r}")
        if kv_cache_precision not in KV_CACHE_PRECISIONS:
            raise InputError(f"kv_cache_precision must be one of {', '.join(KV_CACHE_PRECISIONS)}, not {kv_cache_precision!r}")
        if inference_precision == "bf16" and not cpu_has_bf16():
            raise InputError("inference_precision 'bf16': this CPU has no bf16 instructions (OpenVINO reports no "
                             "BF16 capability); use 'f32' or 'default'")  # fmt: skip
        ov_core = core()
        try:
            model = ov_core.read_model(str(onnx_path))
            self.fused = fuse and fuse_attention(model, layout)
            apply_make_stateful_transformation(model, dict(zip(layout.past_names, layout.present_names)))
            _empty_cache_on_reset(model, layout)
        except RuntimeError as e:  # OpenVINO's frontend error for a graph it cannot read
            raise InputError(f"{onnx_path}: OpenVINO cannot read this graph: {str(e).strip().splitlines()[-1]}") from None
        if inference_precision == "default" and not cpu_has_bf16():
            inference_precision = "f32"  # what OpenVINO picks here, made explicit so that the cache follows it
        if inference_precision == "f32" and kv_cache_precision == "default":
            kv_cache_precision = "f32"  # full precision means the cache too (the plugin's default is u8)
        self.compiled = ov_core.compile_model(model, "CPU", cpu_config(threads, inference_precision, kv_cache_precision))
        self.inference_precision = compute_precision(self.compiled)  # "bf16" / "f32", as OpenVINO reports it
        self.kv_cache_precision = kv_cache_precision_of(self.compiled)  # None: the graph's own cache (not fused)
        self._logits = self.compiled.output(0)

    def close(self) -> None:
        self.compiled = None

    def _steps(self, capacity: int | None = None):
        if self.compiled is None:
            raise InputError(f"{self.source}: this session is closed; load a new one")
        return contextlib.nullcontext(_OvSteps(self))


class _OvSteps(Steps):
    """One call's cache: the states of its own infer request."""

    def __init__(self, owner: OpenVinoSession):
        self.owner, self.layout = owner, owner.layout
        self.request = owner.compiled.create_infer_request()

    def prefill(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        self.request.reset_state()  # each state's initializer: an empty cache for this batch
        return self._run(ids, mask)

    def decode(self, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return self._run(np.asarray(tokens)[:, None], mask)[:, -1]

    def _run(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        out = self.request.infer({INPUT_IDS: np.ascontiguousarray(ids, dtype=np.int64),
                                  ATTENTION_MASK: np.ascontiguousarray(mask, dtype=np.int64)})  # fmt: skip
        return np.array(out[self.owner._logits], dtype=np.float32)  # a copy: the request's tensor is reused

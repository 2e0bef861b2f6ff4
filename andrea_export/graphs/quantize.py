"""Weight-only int8 / int4 graphs for ONNX Runtime: MatMulNBits nodes (ONNX Runtime's contrib op).

`quantize_weights` turns an fp32 export (the standard graph or the KV-cache decoder) into one whose
weight MatMuls are `com.microsoft.MatMulNBits` nodes (weight-only: the graph's activations stay float32):

- int8: ONNX Runtime's own quantizer (`matmul_nbits_quantizer.MatMulNBitsQuantizer`: round to nearest,
  symmetric, one float32 scale per block of 128 along K).
- int4: 4-bit, asymmetric, in blocks of 64 along K, each block with its own scale and zero point
  (quantize_asymmetric's grid), the integers chosen by GPTQ (quantize_gptq) on the fp32 standard graph's
  activations over seeded random ids (solve_int4: once a build, for all its int4 graphs), packed here as the
  op defines them (pack_nbits); the tied head in blocks of 32, or at 8 bits where it alone makes most of int4's
  error (choose_head_bits, measured on the model's own weights at build time). A MatMul whose K the block does
  not divide takes the largest power of two that does (`block_for`; ORT's kernels need >= 16): a block past K
  would be padded with zeros that every step reads (andrea-tiny's K = 64 MatMuls get blocks of 64).

Why this int4: at a fixed number of bytes a step, a block's own range with a zero point fits a block of weights
more closely than a symmetric grid of the same block (relative squared error on ANDREA-120M's weights: 0.0076 at
64 against 0.0106 for ONNX Runtime's symmetric 128), for 4.56 bits a weight, as llama.cpp's Q4_0 spends 4.5;
but what a model keeps is its layers' outputs, not their weights. A layer's inputs are far from isotropic (on
ANDREA-120M's seeded weights the squared mean of most layers' inputs is 15-65 % of E[|x|^2]), so GPTQ, which
rounds each input's row and pushes its error onto the rows still to come, weighed by E[x x^T], keeps the
layers' outputs 1.7-20x closer than rounding at the same bytes: the next-token KL from fp32 falls
from 0.0094 to 0.0027 on ANDREA-120M (llama.cpp's Q4_0 0.0081) and from 0.0087 to 0.0005 on the trained demo.
Random ids calibrate it: no text is needed, and a build's --eval-text stays held out for its perplexity. A block
costs a float32 scale (MatMulNBits takes no float16 ones beside float32 activations), which is why the blocks
are not smaller. The head decides by measurement because it differs by model. The comparison with llama.cpp,
and what else was tried, is in benchmarks/README.md.

Every MatMulNBits has `accuracy_level` 4: ONNX Runtime's CPU kernel then quantizes each activation block
to int8 on the fly and multiplies int8 x int8 (VNNI / AVX2), instead of dequantizing every weight to
float32 at every call. Measured (with blocks of 64 / 32 then) on ANDREA-120M's in-place decoder, 2 threads, decode 1x127, time of fp32
over int8 / int4: 0.08 / 1.53 without it (int8 twelve times SLOWER than fp32), 2.82 / 2.37 with it; on the
trained andrea-tiny, held-out perplexity +0.050 % (int8) and +0.63 % (int4) with it against +0.027 % and
+0.61 % without. onnxruntime-genai's model builder makes the same choice for CPU int4.

Only MatMuls are quantized. The token embedding's Gather stays float32 (the quantizer's
GatherBlockQuantized would make the embedding lookup dequantize, and the lookup reads one row per
token: no bandwidth to save). The tied output projection reads the same embedding transposed
(MatMul(x, Transpose(wte))): MatMulNBits needs a constant B, so it gets its own quantized copy of the
embedding, made here by folding the Transpose into an initializer before quantizing. It is the
largest MatMul of the model (vocab x n_embd), so leaving it float32 would keep most of the decode
bandwidth; the copy costs 0.625 (int4, blocks of 32) / 1.03 (int8, blocks of 128; andrea-tiny 1.0625) bytes per embedding weight beside the float32
table's 4 (measured on andrea-tiny: 0.34 / 0.57 MB beside 2.16 MB; the Q/DQ graphs hold one more). It
is also where most of rounded int4's error came from: on the trained andrea-tiny with the head left float32,
rounded int4's held-out perplexity moved +0.10 % instead of +0.61 %, its top-1 agreement on random ids is 95 %
instead of 63 % (int8: +0.004 % instead of +0.027 %).

`MatMulNBits` runs in ONNX Runtime only: TensorRT and TensorRT-RTX do not
import it. The engines get `write_qdq`'s graph instead: the fp32 weights quantized again, in the form full
TensorRT imports (NvInfer.h, IDequantizeLayer: block quantization for INT4 only, every scale strictly
positive, symmetric), as standard DequantizeLinear -> MatMul (opset 21): int8 one scale per output column,
int4 blocks of 32 with each block's scale searched (quantize_symmetric). ORT's values cannot be re-laid
out for TensorRT: its int8 is block-wise and about half its scales are negative (the symmetric quantizer
puts a block's extreme on the lowest value whatever its sign). TensorRT-RTX 1.7 builds the same graph,
fusing each block's pair into one dequantize-and-multiply kernel (int8 "CastMulCastFc", int4
"ReplCastMulCastFc" in its layer report; the tied head dequantizes in a kernel of its own before its
MatMul). The accuracy of each form is in verify/thresholds.py; `engine/onnx_rules.py` checks the rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from ..errors import ConfigError, ExportError
from ..folder.atomic import staging
from ..names import PRECISION_KEY

# precision -> MatMulNBits bits and largest block along K, for the output projection (head) and the others (a
# node whose K it does not divide takes the largest power of two that does, down to MIN_BLOCK: ORT's kernels take
# powers of 2 >= 16). Why 128 and int4's head 32: see the module's docstring.
QUANT = {"int8": dict(bits=8, block_size=128, head_block_size=128, accuracy_level=4, zero_points=False),
         "int4": dict(bits=4, block_size=64, head_block_size=32, accuracy_level=4, zero_points=True)}
MIN_BLOCK = 16
HEAD_SHARE = 0.5  # an int4 head goes to 8 bits when it alone makes this share of int4's error (choose_head_bits)
# precision -> the engines' Q/DQ layout (to_qdq): int8 per output column, int4 in blocks of 32 along K
ENGINE_QUANT: dict[str, dict[str, Any]] = {"int8": dict(bits=8, block_size=None), "int4": dict(bits=4, block_size=32)}
# int4 (MatMulNBits) range candidates, as fractions of a block's range about its centre (quantize_asymmetric)
SHRINK = tuple(np.linspace(0.7, 1.0, 16).tolist())
# int4 scale candidates, as multiples of a block's largest magnitude (quantize_symmetric); 1/7 among them
SCALE_SEARCH = tuple(sorted({*np.linspace(1 / 8, 1 / 6, 17).tolist(), 1 / 7}))
TIED_HEAD = "lm_head.weight.T"  # the folded transpose of the tied embedding (quantized copy)
# int4's GPTQ (solve_int4): the seeded random ids whose activations weigh each weight's error (no text: a build's
# --eval-text stays held out for its perplexity), run `chunk` prompts at a time; the damping of the moment
CALIBRATION = dict(seed=1, prompts=128, length=64, chunk=8)
GPTQ_DAMP = 0.01
# (weight_digest, bits, block, quantize_gptq's form) -> (q, scales, zero points)
Solved = dict[tuple[str, int, int, str], tuple[np.ndarray, np.ndarray, np.ndarray]]


def quantize_weights(onnx_in: str | Path, onnx_out: str | Path, precision: str, head_bits: int | None = None,
                     solved: Solved | None = None) -> Path:
    """Write `onnx_out`: the fp32 graph `onnx_in` with its weight MatMuls as MatMulNBits of `precision`;
    `head_bits`: the tied head's width in an int4 graph (4 or 8, what choose_head_bits measured; None: 4);
    `solved`: its int4 weights as solve_int4 computed them (None: each block rounded to nearest).

    Metadata (config, KV layout, weights source) is carried over; `andrea.precision` is set. Weights go
    to `<onnx_out>.data` when the input kept them externally. Written atomically."""
    onnx_in, onnx_out = Path(onnx_in), Path(onnx_out)
    model, meta, external = _fp32_model(onnx_in, precision)
    out = quantized(model, precision, head_bits, what=onnx_in.name, solved=solved)
    del out.metadata_props[:]
    for k, v in meta.items():
        out.metadata_props.add(key=k, value=v)
    out.metadata_props.add(key=PRECISION_KEY, value=precision)
    return _save_checked(out, onnx_out, external, f"{precision} graph of {onnx_in.name}")


def _fp32_model(onnx_in: Path, precision: str) -> tuple[onnx.ModelProto, dict[str, str], bool]:
    """(the fp32 graph with its weights, its metadata, whether it kept them externally), refused when it is not
    an fp32 graph or `precision` not a weight-only one."""
    if precision not in QUANT:
        raise ConfigError(f"weight-only precision must be one of {', '.join(QUANT)}, got {precision!r}")
    if not onnx_in.is_file():
        raise ExportError(f"{onnx_in}: no such ONNX file")
    external = any(t.data_location == TensorProto.EXTERNAL
                   for t in onnx.load(str(onnx_in), load_external_data=False).graph.initializer)
    model = onnx.load(str(onnx_in))
    meta = {p.key: p.value for p in model.metadata_props}
    if meta.get(PRECISION_KEY, "fp32") != "fp32":
        raise ExportError(f"{onnx_in}: is already a {meta[PRECISION_KEY]} graph; quantize the fp32 export")
    return model, meta, external


def quantized(model: onnx.ModelProto, precision: str, head_bits: int | None = None, *, body: bool = True,
              what: str = "the graph", solved: Solved | None = None) -> onnx.ModelProto:
    """The loaded fp32 `model`, changed in place: its weight MatMuls (the tied head's folded copy too) as
    MatMulNBits of `precision`, each in its block (block_for). `head_bits` 8 puts an int4 graph's head at 8 bits
    (in int8's blocks); `body` False quantizes the head alone (choose_head_bits measures it so). `solved`: int4
    weights solve_int4 computed (a weight it holds at its bits and block takes them; any other is rounded)."""
    _fold_tied_head(model)
    plan = _plan(model, precision, head_bits, body, what)
    if QUANT[precision]["zero_points"]:
        return _with_matmulnbits(model, plan, QUANT[precision]["accuracy_level"], solved or {})
    blocks: dict[int, list[str]] = {}
    for name, (_, block) in plan.items():
        blocks.setdefault(block, []).append(name)
    return _ort_quantized(model, blocks, precision)


def _plan(model: onnx.ModelProto, precision: str, head_bits: int | None, body: bool,
          what: str) -> dict[str, tuple[int, int]]:
    """node name -> (bits, block) of each weight MatMul of `model` (its tied head folded) that `precision` quantizes;
    unnamed ones are named (the quantizer tells nodes apart by name)."""
    if head_bits not in (None, 4, 8):
        raise ConfigError(f"the tied head is quantized at 4 or 8 bits, not {head_bits!r}")
    inits = {t.name: t for t in model.graph.initializer}
    plan: dict[str, tuple[int, int]] = {}
    for i, node in enumerate(model.graph.node):
        w = inits.get(node.input[1]) if node.op_type == "MatMul" else None
        head = w is not None and node.input[1] == TIED_HEAD
        if w is None or not (body or head):
            continue
        bits = head_bits if head and head_bits else QUANT[precision]["bits"]
        block = block_for(w.dims[0], "int8" if bits == 8 else precision, head=head)
        if block is None:
            raise ConfigError(f"{what}: MatMul '{node.name}' has K = {w.dims[0]}, not a multiple of "
                              f"{MIN_BLOCK}, the smallest {precision} block")
        node.name = node.name or f"matmul_{i}"
        plan[node.name] = (bits, block)
    if not plan:
        raise ExportError(f"{what}: no MatMul with a constant weight to quantize")
    return plan


def solve_int4(onnx_fp32: str | Path, head_bits: int | None = None) -> Solved:
    """int4 weights for every graph of a build, solved once on its fp32 standard graph (input ids -> logits):
    each weight MatMul int4 quantizes, in both of int4's forms (MatMulNBits' asymmetric blocks, `_plan`; the
    engines' symmetric blocks, ENGINE_QUANT), by GPTQ (quantize_gptq), its error weighed by the second moment
    of its input over CALIBRATION's seeded random ids. Keyed by the weight's values and form, so the decoders'
    copies of the same weights take the same integers."""
    engine = ENGINE_QUANT["int4"]["block_size"]
    solved: Solved = {}
    for (bits, block), w, moment in _weights_and_moments(Path(onnx_fp32), head_bits):
        key = weight_digest(w)
        solved[key, bits, block, "asymmetric"] = quantize_gptq(w, moment, bits, block)
        if bits == 4 and w.shape[0] % engine == 0:
            solved[key, 4, engine, "symmetric"] = quantize_gptq(w, moment, 4, engine, form="symmetric")
    return solved


def weight_moments(onnx_fp32: str | Path) -> dict[str, np.ndarray]:
    """E[x x^T] of the input of each weight MatMul of an fp32 standard graph (its tied head folded) over
    CALIBRATION's random ids, keyed by the weight's weight_digest: what GPTQ weighs a weight's error by, for a
    writer of another format (deploy/gguf.py's q4_0)."""
    return {weight_digest(w): moment for _, w, moment in _weights_and_moments(Path(onnx_fp32), None)}


def _weights_and_moments(onnx_fp32: Path, head_bits: int | None):
    """((bits, block) in int4's plan, the float32 weight [K, N], E[x x^T] of its input) for each weight MatMul of
    the fp32 standard graph `onnx_fp32` (its tied head folded), in graph order; each moment is dropped once its
    last reader is given it (a moment is K x K float64: 1 GB of them for ANDREA-120M)."""
    model = _fp32_model(onnx_fp32, "int4")[0]
    _fold_tied_head(model)
    plan = _plan(model, "int4", head_bits, True, onnx_fp32.name)
    inits = {t.name: t for t in model.graph.initializer}
    nodes = [n for n in model.graph.node if n.name in plan]
    moments = input_moments(model, onnx_fp32, sorted({n.input[0] for n in nodes}))
    readers = {x: sum(n.input[0] == x for n in nodes) for x in moments}
    for n in nodes:
        yield plan[n.name], numpy_helper.to_array(inits[n.input[1]]).astype(np.float32), moments[n.input[0]]
        readers[n.input[0]] -= 1
        if not readers[n.input[0]]:
            del moments[n.input[0]]


@dataclass(frozen=True)
class Int4Weights:
    """What an int4 build's graphs share (choose_int4): the GPTQ-solved weights, the tied head's width, and the
    share of int4's error the head alone made when that width was chosen (choose_head_bits)."""

    solved: Solved
    head_bits: int
    head_share: float

    def record(self) -> dict[str, Any]:
        """How the weights were made, for the build's manifest ("quantization")."""
        calibration = {k: CALIBRATION[k] for k in ("seed", "prompts", "length")}
        return {"method": "gptq", "calibration": {"ids": "random", **calibration}, "damp": GPTQ_DAMP,
                "head_bits": self.head_bits, "head_error_share": round(self.head_share, 4)}


def choose_int4(onnx_fp32: str | Path) -> Int4Weights:
    """An int4 build's weights, solved once on its fp32 standard graph (solve_int4), and its head's width,
    measured on those weights (choose_head_bits)."""
    solved = solve_int4(onnx_fp32)
    head_bits, share = choose_head_bits(onnx_fp32, solved=solved)
    return Int4Weights(solved, head_bits, share)


def weight_digest(w: np.ndarray) -> str:
    """A weight's identity across a build's graphs (each export holds its own copy): its float32 values and shape."""
    import hashlib

    return hashlib.blake2b(np.ascontiguousarray(w, np.float32).tobytes() + str(w.shape).encode(),
                           digest_size=16).hexdigest()


def input_moments(model: onnx.ModelProto, source: Path, names: list[str]) -> dict[str, np.ndarray]:
    """name -> E[x x^T] (float64 [K, K]) of each tensor `names` of the loaded standard graph `model` (from `source`)
    over CALIBRATION's random ids, run by ONNX Runtime's CPU provider a few prompts at a time."""
    import tempfile

    import onnxruntime as ort
    from onnx import helper

    from ..names import INPUT_IDS
    from .layout import config_of

    cfg = config_of({p.key: p.value for p in model.metadata_props}, source)
    rng = np.random.default_rng(CALIBRATION["seed"])
    ids = rng.integers(0, cfg.vocab_size, (CALIBRATION["prompts"], min(CALIBRATION["length"], cfg.n_positions)),
                       dtype=np.int64)
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    del probe.graph.output[:]
    probe.graph.output.extend(helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names)
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    with tempfile.TemporaryDirectory(prefix="andrea-calib-") as tmp:  # a model over 2 GB serializes no other way
        onnx.save(probe, f"{tmp}/m.onnx", save_as_external_data=True, location="m.onnx.data")
        del probe
        session = ort.InferenceSession(f"{tmp}/m.onnx", opts, providers=["CPUExecutionProvider"])
        sums: dict[str, np.ndarray] = {}
        for i in range(0, len(ids), CALIBRATION["chunk"]):
            for name, x in zip(names, session.run(names, {INPUT_IDS: ids[i:i + CALIBRATION["chunk"]]})):
                x = x.reshape(-1, x.shape[-1])
                sums[name] = sums.get(name, 0) + (x.T @ x).astype(np.float64)
    return {name: s / ids.size for name, s in sums.items()}


def choose_head_bits(onnx_fp32: str | Path, share: float = HEAD_SHARE,
                     solved: Solved | None = None) -> tuple[int, float]:
    """(the int4 build's tied-head width, the share of int4's error its head makes), by measurement on the
    model's own weights: on seeded random ids, the KL divergence from fp32 of the graph with its head alone at
    int4 and of the whole int4 graph (`solved`: int4's weights as solve_int4 chose them, as the build's graphs
    take them). 8 bits when the head alone makes at least `share` of the whole's (it is then where the error
    sits: the trained andrea-tiny's head rounded made 73 %), else 4 (solved, the trained demo's head makes
    40 %, ANDREA-120M's seeded weights' 8 %; the head is 7 % of the weights ANDREA-120M reads per step)."""
    import tempfile

    import onnxruntime as ort

    from ..names import INPUT_IDS
    from .layout import config_of

    onnx_fp32 = Path(onnx_fp32)
    meta = {p.key: p.value for p in onnx.load(str(onnx_fp32), load_external_data=False).metadata_props}
    if meta.get(PRECISION_KEY, "fp32") != "fp32":
        raise ExportError(f"{onnx_fp32}: is already a {meta[PRECISION_KEY]} graph; measure the fp32 export")
    cfg = config_of(meta, onnx_fp32)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, min(64, cfg.n_positions)), dtype=np.int64)

    def logits(path: str | Path) -> np.ndarray:
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"]).run(None, {INPUT_IDS: ids})[0]

    def int4_logits(body: bool) -> np.ndarray:  # through a file: a model over 2 GB serializes no other way
        with tempfile.TemporaryDirectory(prefix="andrea-head-") as tmp:
            m = quantized(onnx.load(str(onnx_fp32)), "int4", body=body, what=onnx_fp32.name, solved=solved)
            onnx.save(m, f"{tmp}/m.onnx", save_as_external_data=True, location="m.onnx.data")
            return logits(f"{tmp}/m.onnx")

    ref = logits(onnx_fp32)
    head, whole = _kl(ref, int4_logits(body=False)), _kl(ref, int4_logits(body=True))
    ratio = head / whole if whole > 0 else 0.0
    return (8 if ratio >= share else 4), ratio


def _kl(ref: np.ndarray, got: np.ndarray) -> float:
    """Mean KL(ref || got) of the next-token distributions of two logits arrays [..., vocab]."""
    a = ref - ref.max(-1, keepdims=True)
    b = got - got.max(-1, keepdims=True)
    la, lb = a - np.log(np.exp(a).sum(-1, keepdims=True)), b - np.log(np.exp(b).sum(-1, keepdims=True))
    return float((np.exp(la) * (la - lb)).sum(-1).mean())


def _ort_quantized(model: onnx.ModelProto, blocks: dict[int, list[str]], precision: str) -> onnx.ModelProto:
    """`model` with the MatMuls `blocks` names (block -> node names) as ONNX Runtime's quantizer writes them:
    symmetric round to nearest, one pass per block size (the others' MatMuls left for theirs)."""
    import logging

    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    log = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level, log.level = log.level, logging.WARNING  # it logs every node at INFO
    try:
        for block, names in blocks.items():
            others = [n for b, ns in blocks.items() if b != block for n in ns]
            q = MatMulNBitsQuantizer(model, bits=QUANT[precision]["bits"], block_size=block, is_symmetric=True,
                                     accuracy_level=QUANT[precision]["accuracy_level"], nodes_to_exclude=others,
                                     op_types_to_quantize=("MatMul",))  # fmt: skip
            q.process()
            model = q.model.model
    finally:
        log.setLevel(level)
    return model


def _with_matmulnbits(model: onnx.ModelProto, plan: dict[str, tuple[int, int]], level: int,
                      solved: Solved) -> onnx.ModelProto:
    """`model` with each MatMul that `plan` names (node name -> bits, block) as a MatMulNBits with zero points,
    its weight quantized by quantize_asymmetric and packed as ONNX Runtime's contrib op defines it: B uint8
    [N, K / block, block * bits / 8] (two 4-bit values a byte, the first in the low nibble), scales [N * K /
    block], zero points packed the same way along each column's blocks. The float weight is dropped unless
    another node reads it (the embedding table, which the tied head's folded copy came from). A weight `solved`
    holds at its (bits, block) takes its integers from there (solve_int4), any other quantize_asymmetric's."""
    from onnx import helper

    g = model.graph
    inits = {t.name: t for t in g.initializer}
    nodes, used = [], set()
    for n in g.node:
        if n.name not in plan or n.op_type != "MatMul":
            nodes.append(n)
            continue
        w, (bits, block) = inits[n.input[1]], plan[n.name]
        K, N = w.dims
        array = numpy_helper.to_array(w).astype(np.float32)
        q, scale, zp = solved.get((weight_digest(array), bits, block, "asymmetric")) or \
            quantize_asymmetric(array, bits, block)
        packed, zeros = pack_nbits(q, zp, bits, block)
        names = [f"{w.name}_Q{bits}", f"{w.name}_scales", f"{w.name}_zp"]
        g.initializer.extend([numpy_helper.from_array(packed, names[0]),
                              numpy_helper.from_array(np.ascontiguousarray(scale.T).reshape(-1), names[1]),
                              numpy_helper.from_array(zeros, names[2])])
        used.add(w.name)
        nodes.append(helper.make_node("MatMulNBits", [n.input[0], *names], list(n.output), name=n.name,
                                      domain="com.microsoft", K=K, N=N, bits=bits, block_size=block,
                                      accuracy_level=level))
    readers = {i for n in nodes for i in n.input}
    del g.node[:]
    g.node.extend(nodes)
    keep = [t for t in g.initializer if t.name not in used or t.name in readers]
    del g.initializer[:]
    g.initializer.extend(keep)
    if not any(op.domain == "com.microsoft" for op in model.opset_import):
        model.opset_import.add(domain="com.microsoft", version=1)
    return model


def quantize_asymmetric(w: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Block-wise asymmetric quantization of a [K, N] weight along K: integers q [K, N] in [0, 2^bits - 1],
    float32 scales [K / block, N] and integer zero points [K / block, N], w ~ (q - zero point) * scale, each
    block on its own grid (_asymmetric_grid), rounded to nearest. On ANDREA-120M's Gaussian weights, blocks of
    64: relative squared error 0.0076 (min-max alone 0.0083; llama.cpp's Q4_0, symmetric in blocks of 32 with
    float16 scales, 0.0074; ONNX Runtime's symmetric blocks of 128 0.0106)."""
    qmax = 2**bits - 1
    K, N = w.shape
    groups = w.reshape(K // block, block, N).astype(np.float32)
    scale, zp = _asymmetric_grid(groups, bits)
    q = np.clip(np.rint(groups / scale) + zp, 0, qmax).reshape(K, N).astype(np.uint8)
    return q, scale[:, 0, :], zp[:, 0, :].astype(np.uint8)


def _asymmetric_grid(groups: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(scales, zero points), float32 [G, 1, N], of blocks `groups` [G, block, N]: each block's range (widened to
    hold 0, so that 0 is exact) shrunk about its centre by the factor of SHRINK with the least squared error of
    the block rounded on that grid (the extremes clipped where that pays)."""
    qmax = 2**bits - 1
    lo, hi = np.minimum(groups.min(axis=1, keepdims=True), 0), np.maximum(groups.max(axis=1, keepdims=True), 0)
    mid, half = (lo + hi) / 2, (hi - lo) / 2
    best_err = np.full(lo.shape, np.inf, np.float32)
    scale, zp = np.ones_like(lo), np.zeros_like(lo)
    for f in SHRINK:
        s = np.where(half > 0, 2 * half * f / qmax, 1.0).astype(np.float32)
        z = np.clip(np.rint((half * f - mid) / s), 0, qmax)
        err = (((np.clip(np.rint(groups / s) + z, 0, qmax) - z) * s - groups) ** 2).sum(axis=1, keepdims=True)
        better = err < best_err
        best_err, scale, zp = np.where(better, err, best_err), np.where(better, s, scale), np.where(better, z, zp)
    return scale, zp


def quantize_gptq(w: np.ndarray, moment: np.ndarray, bits: int, block: int, damp: float = GPTQ_DAMP,
                  form: str = "asymmetric") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Integers, scales and zero points [K / block, N] for a [K, N] weight in `form`: "asymmetric" as
    quantize_asymmetric's (integers in [0, 2^bits - 1]); "symmetric" as quantize_symmetric's (signed integers,
    zero points 0); "q4_0" as ggml's Q4_0 (4 bits, integers in [0, 15] about a zero point of 8, each block's scale
    its largest-magnitude value / -8 in float16), chosen by GPTQ (Frantar et al., 2022) to keep the layer's output
    rather than its weights: rows (inputs) are rounded one at a time, and each row's error, weighed by the inverse
    of `moment` (E[x x^T] of the layer's input, [K, K], damped by `damp` times its mean diagonal), is pushed onto
    the rows not yet rounded. A block's grid is set from its rows as they stand when the block is reached. Rows are taken in spans of at least
    128, the rest of the weight updated once a span (the lazy batch update of GPTQ's reference code).

    On ANDREA-120M's seeded weights the inputs are far from isotropic (most layers' squared input mean is 15-65 %
    of E[|x|^2]), so the output error falls 1.7-20x below rounding's at the same bytes."""
    qmax = 2**bits - 1
    K, N = w.shape
    W = w.astype(np.float64)
    H = np.array(moment, np.float64)
    idle = np.diag(H) <= 0  # an input never seen: its rows are rounded with no one to carry their error
    H[idle, :], H[:, idle] = 0, 0
    H[idle, idle] = 1
    H[np.diag_indices(K)] += damp * np.diag(H).mean()
    U = np.linalg.cholesky(np.linalg.inv(H)).T  # upper factor of H^-1: row k's error spreads over rows > k
    q = np.empty((K, N), np.uint8)
    scales, zps = np.empty((K // block, N), np.float32), np.empty((K // block, N), np.uint8)
    span = block * max(1, 128 // block)
    for i1 in range(0, K, span):
        i2 = min(i1 + span, K)
        errs = np.empty((i2 - i1, N))
        for k in range(i1, i2):
            if k % block == 0:
                s, z = _gptq_grid(W[None, k:k + block].astype(np.float32), bits, form)
                scales[k // block], zps[k // block] = s, z
            row = W[k].astype(np.float32)
            q[k] = np.clip(np.rint(row / s) + z, 0, qmax)
            errs[k - i1] = (W[k] - (q[k] - z) * s) / U[k, k]
            W[k + 1:i2] -= np.outer(U[k, k + 1:i2], errs[k - i1])
        W[i2:] -= U[i1:i2, i2:].T @ errs
    if form == "symmetric":
        return q.astype(np.int8) - np.int8(2 ** (bits - 1)), scales, np.zeros_like(zps)
    return q, scales, zps


def _gptq_grid(group: np.ndarray, bits: int, form: str) -> tuple[np.ndarray, np.ndarray]:
    """(scales [N], zero points [N]) of one block [1, block, N] in quantize_gptq's `form`."""
    if form == "asymmetric":
        scale, zp = _asymmetric_grid(group, bits)
        return scale[0, 0], zp[0, 0]
    zero = np.full(group.shape[2], 2 ** (bits - 1), np.float32)
    if form == "symmetric":
        return _symmetric_scales(group, bits)[0, 0], zero
    if form == "q4_0" and bits == 4:  # ggml's quantize_row_q4_0_ref: d = max / -8, stored in float16
        extreme = np.take_along_axis(group[0], np.abs(group[0]).argmax(axis=0)[None], axis=0)[0]
        d = (extreme / -8).astype(np.float16).astype(np.float32)
        return np.where(d != 0, d, 1.0).astype(np.float32), zero  # an all-zero block: any scale keeps it 0
    raise ValueError(f"no GPTQ grid {form!r} at {bits} bits")


def pack_nbits(q: np.ndarray, zp: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(B [N, K / block, block * bits / 8], zero points [N * ceil(K / block * bits / 8)]) as MatMulNBits reads
    them, from quantize_asymmetric's q [K, N] and zero points [K / block, N]: column by column, 4-bit values
    two a byte with the first in the low nibble (a column's odd block count padded with a zero nibble)."""
    K, N = q.shape
    cols, zcols = q.T.reshape(N, K // block, block), np.ascontiguousarray(zp.T)
    if bits == 8:
        return np.ascontiguousarray(cols), zcols.reshape(-1)
    if bits != 4:
        raise ValueError(f"MatMulNBits packing for 4 or 8 bits, not {bits}")
    if zcols.shape[1] % 2:
        zcols = np.concatenate([zcols, np.zeros((N, 1), np.uint8)], axis=1)
    return (cols[..., 0::2] | (cols[..., 1::2] << 4)).astype(np.uint8), \
        (zcols[:, 0::2] | (zcols[:, 1::2] << 4)).astype(np.uint8).reshape(-1)


def write_qdq(onnx_fp32: str | Path, onnx_out: str | Path, precision: str, head_bits: int | None = None,
              solved: Solved | None = None) -> Path:
    """Write `onnx_out`: the fp32 graph `onnx_fp32` with its weight MatMuls as TensorRT's Q/DQ of `precision`
    (to_qdq; `head_bits` 8: an int4 graph's head in int8's form; `solved`: int4's weights from solve_int4), for
    the engines. Metadata is carried over, `andrea.precision` set; written atomically."""
    onnx_fp32, onnx_out = Path(onnx_fp32), Path(onnx_out)
    external = any(t.data_location == TensorProto.EXTERNAL
                   for t in onnx.load(str(onnx_fp32), load_external_data=False).graph.initializer)
    return _save_checked(to_qdq(onnx.load(str(onnx_fp32)), precision, head_bits, solved), onnx_out, external,
                         f"Q/DQ graph of {onnx_fp32.name}")


def _save_checked(model: onnx.ModelProto, onnx_out: Path, external: bool, what: str) -> Path:
    """Write `model` to `onnx_out` atomically (weights to `<onnx_out>.data` when `external`), checked by
    onnx's checker first: a wrong quantization or fold says what broke instead of landing."""
    with staging(onnx_out.parent) as tmp:
        kw: dict[str, Any] = dict(save_as_external_data=True, location=onnx_out.name + ".data") if external else {}
        onnx.save(model, str(tmp / onnx_out.name), **kw)
        try:
            onnx.checker.check_model(str(tmp / onnx_out.name))
        except Exception as e:
            raise ExportError(f"{what} does not check: {str(e).splitlines()[0]}") from e
    return onnx_out


def block_for(k: int, precision: str, head: bool = False) -> int | None:
    """The MatMulNBits block of a weight with `k` rows (`head`: the output projection's): the largest power
    of two from MIN_BLOCK to QUANT[precision]'s block that divides k (a block past k would be padded with
    zeros, quantizing nothing into bytes every step reads), or None."""
    block = QUANT[precision]["head_block_size" if head else "block_size"]
    while block >= MIN_BLOCK:
        if k % block == 0:
            return block
        block //= 2
    return None


def check_model_shape(cfg, precision: str) -> None:
    """Refuse, before anything is built, a model whose MatMuls (K = n_embd and 4 * n_embd) do not split
    into whole blocks of `precision` (a padded block would quantize zeros and waste its bytes)."""
    if precision in QUANT and block_for(cfg.n_embd, precision) is None:
        raise ConfigError(f"--precision {precision} quantizes the weights in blocks of {MIN_BLOCK} to "
                          f"{QUANT[precision]['block_size']} along n_embd; {cfg.name}'s n_embd = {cfg.n_embd} "
                          f"is not a multiple of {MIN_BLOCK}: build fp32, fp16 or bf16")


def matmulnbits(model: onnx.ModelProto) -> list[dict]:
    """bits, block_size, K, N, accuracy_level of every MatMulNBits node of `model` (what a test or an inspection reads)."""
    out = []
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            a = {x.name: onnx.helper.get_attribute_value(x) for x in node.attribute}
            out.append({"name": node.name, "bits": a["bits"], "block_size": a["block_size"], "K": a["K"], "N": a["N"],
                        "accuracy_level": a.get("accuracy_level", 0)})
    return out


def _fold_tied_head(model: onnx.ModelProto) -> None:
    """MatMul(x, Transpose(W)) with W a 2-D initializer -> MatMul(x, W.T as its own initializer), so the
    quantizer sees a constant weight. W itself stays for its other readers (the embedding Gather)."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    readers: dict[str, int] = {}
    for n in g.node:
        for i in n.input:
            readers[i] = readers.get(i, 0) + 1
    drop = []
    for n in g.node:
        if n.op_type != "MatMul" or n.input[1] in inits:
            continue
        t = producer.get(n.input[1])
        if t is None or t.op_type != "Transpose" or t.input[0] not in inits or len(inits[t.input[0]].dims) != 2:
            continue
        perm = [a.ints for a in t.attribute if a.name == "perm"]
        if perm and list(perm[0]) != [1, 0]:
            continue
        w = numpy_helper.to_array(inits[t.input[0]])
        g.initializer.append(numpy_helper.from_array(np.ascontiguousarray(w.T), TIED_HEAD))
        n.input[1] = TIED_HEAD
        if readers[t.output[0]] == 1:
            drop.append(t)
        break  # one tied head per graph
    for t in drop:
        g.node.remove(t)


def quantize_symmetric(w: np.ndarray, bits: int, block: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Round-to-nearest symmetric quantization of a [K, N] weight with strictly positive scales, as TensorRT
    takes them: integers in [-2^(bits-1), 2^(bits-1) - 1] and float32 scales [N] (block None: one per output
    column) or [K / block, N].

    int8: scale = amax / 127. int4: each block's scale is the one of SCALE_SEARCH (times the block's amax)
    with the least squared weight error. A positive scale cannot do what ONNX Runtime's negative ones do (put
    the block's extreme on -8 whatever its sign): on [-8, 7] a positive extreme has 7 steps, and amax / 7
    (ModelOpt's RTN, one of the candidates) or amax / 8 with the extreme clipped to 7 each lose accuracy
    (measured in verify/thresholds.py); the search recovers most of it without calibration data."""
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    K, N = w.shape
    groups = (w.reshape(K // block, block, N) if block else w.reshape(1, K, N)).astype(np.float32)
    best = _symmetric_scales(groups, bits)
    q = np.clip(np.rint(groups / best), qmin, qmax).reshape(K, N)
    scale = best[:, 0, :]
    return q, (scale if block else scale[0])


def _symmetric_scales(groups: np.ndarray, bits: int) -> np.ndarray:
    """Scales, float32 [G, 1, N], of blocks `groups` [G, block, N] on [-2^(bits-1), 2^(bits-1) - 1]: int8's
    amax / 127, int4's the candidate of SCALE_SEARCH (times the block's amax) with the least squared error."""
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    amax = np.abs(groups).max(axis=1, keepdims=True)
    amax = np.where(amax > 0, amax, 1.0)  # an all-zero group still gets a valid (positive) scale

    def candidate(f: float) -> tuple[np.ndarray, np.ndarray]:  # (scale, its squared error per group)
        scale = (amax * f).astype(np.float32)
        return scale, ((np.clip(np.rint(groups / scale), qmin, qmax) * scale - groups) ** 2).sum(axis=1, keepdims=True)

    first, *others = SCALE_SEARCH if bits == 4 else (1 / qmax,)
    best, best_err = candidate(first)
    for f in others:
        scale, err = candidate(f)
        best, best_err = np.where(err < best_err, scale, best), np.minimum(err, best_err)
    return best


def to_qdq(model: onnx.ModelProto, precision: str, head_bits: int | None = None,
           solved: Solved | None = None) -> onnx.ModelProto:
    """The fp32 graph `model` with every weight MatMul (the folded tied head too) as DequantizeLinear ->
    MatMul in the form full TensorRT imports (ENGINE_QUANT; engine/onnx_rules.py holds its rules): int8
    per output column (axis 1, no block: TensorRT block-quantizes INT4 only), int4 in blocks of 32 along K
    (axis 0), scales strictly positive, no zero point. TensorRT-RTX builds the same graph. Opset 21
    (int4). The embedding Gather stays float32, as in quantize_weights. `head_bits` 8: an int4 graph's tied head
    in int8's form (quantize_weights' head at 8 bits, choose_head_bits). A weight `solved` holds in this form
    (solve_int4) takes its integers and scales from there; any other is rounded (quantize_symmetric)."""
    import ml_dtypes

    if precision not in ENGINE_QUANT:
        raise ConfigError(f"weight-only precision must be one of {', '.join(ENGINE_QUANT)}, got {precision!r}")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    meta = {p.key: p.value for p in out.metadata_props}
    if meta.get(PRECISION_KEY, "fp32") != "fp32":
        raise ExportError(f"the graph is already {meta[PRECISION_KEY]}; write the Q/DQ graph from the fp32 export")
    _fold_tied_head(out)
    g = out.graph
    inits = {t.name: t for t in g.initializer}
    nodes, used = [], set()
    for n in g.node:
        w = inits.get(n.input[1]) if n.op_type == "MatMul" and len(n.input) > 1 else None
        if w is None or len(w.dims) != 2:
            nodes.append(n)
            continue
        form = "int8" if head_bits == 8 and n.input[1] == TIED_HEAD else precision
        bits, block = ENGINE_QUANT[form]["bits"], ENGINE_QUANT[form]["block_size"]
        if block and w.dims[0] % block:
            raise ConfigError(f"MatMul '{n.name}' has K = {w.dims[0]}, not a multiple of the {precision} block of {block}")
        array = numpy_helper.to_array(w).astype(np.float32)
        got = (solved or {}).get((weight_digest(array), bits, block, "symmetric")) if block else None
        q, scale = got[:2] if got else quantize_symmetric(array, bits, block)
        q = q.astype(np.int8 if bits == 8 else ml_dtypes.int4)
        wq, ws = f"{w.name}_q{bits}", f"{w.name}_q{bits}_scale"
        g.initializer.extend([numpy_helper.from_array(np.ascontiguousarray(q), wq),
                              numpy_helper.from_array(np.ascontiguousarray(scale), ws)])
        used.add(w.name)
        attrs = dict(axis=0, block_size=block) if block else dict(axis=1)
        dq = f"{w.name}_dq"
        nodes.append(onnx.helper.make_node("DequantizeLinear", [wq, ws], [dq], name=f"{n.name}_dq", **attrs))
        nodes.append(onnx.helper.make_node("MatMul", [n.input[0], dq], list(n.output), name=n.name))
    if not used:
        raise ExportError("no MatMul with a constant weight to quantize")
    readers = {i for n in nodes for i in n.input}
    del g.node[:]
    g.node.extend(nodes)
    keep = [t for t in g.initializer if t.name not in used or t.name in readers]  # wte stays for the Gather
    del g.initializer[:]
    g.initializer.extend(keep)
    for op in out.opset_import:
        if op.domain in ("", "ai.onnx") and op.version < 21:
            op.version = 21
    del out.metadata_props[:]
    for k, v in {**meta, PRECISION_KEY: precision}.items():
        out.metadata_props.add(key=k, value=v)
    return out

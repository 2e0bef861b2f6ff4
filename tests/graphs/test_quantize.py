"""Weight-only int8 / int4 (quantize.py): ONNX Runtime's MatMulNBits graphs, their Q/DQ twins for the
engines, and whole builds of the trained tiny model with their accuracy in verify.json."""

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from andrea_export.cli import main
from andrea_export.config import ANDREA_TINY, ModelConfig
from andrea_export.errors import ConfigError, ExportError
from andrea_export.graphs.quantize import (
    QUANT,
    TIED_HEAD,
    block_for,
    check_model_shape,
    matmulnbits,
    quantize_weights,
    write_qdq,
)
from andrea_export.names import PRECISIONS, WEIGHT_ONLY
from andrea_export.verify.thresholds import MAX_PPL_REL

# andrea-tiny: per layer qkv (64 x 192), proj (64 x 64), fc (64 x 256), fc2 (256 x 64); the tied head 64 x 8449
TINY_MATMULS = sorted([(64, 192), (64, 64), (64, 256), (256, 64)] * ANDREA_TINY.n_layer + [(64, ANDREA_TINY.vocab_size)])


def _run(path, ids, qdq_accuracy_level=None):
    """Logits of `path` in ONNX Runtime; `qdq_accuracy_level`: the level of the MatMulNBits that ONNX
    Runtime fuses a 4-bit DequantizeLinear -> MatMul into (to compute as quantize.py's nodes do)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if qdq_accuracy_level is not None:
        options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(qdq_accuracy_level))
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]).run(None, {"input_ids": ids})[0]


@pytest.mark.parametrize("precision", WEIGHT_ONLY)
def test_every_weight_matmul_becomes_matmulnbits(tiny_onnx, tmp_path, precision):
    out = quantize_weights(tiny_onnx, tmp_path / f"model.{precision}.onnx", precision)
    model = onnx.load(str(out))
    q = matmulnbits(model)
    assert sorted((m["K"], m["N"]) for m in q) == TINY_MATMULS  # the tied head too
    assert {m["bits"] for m in q} == {QUANT[precision]["bits"]}
    # int8 in blocks of 128 along K where K allows, int4 in blocks of 64, else the largest power of two
    # dividing K: a block past K would be padded with zeros (andrea-tiny's K = 64 MatMuls at 128 would read
    # twice their bytes); int4's head (N = vocab) in blocks of 32
    head = [m for m in q if m["N"] == ANDREA_TINY.vocab_size]
    assert len(head) == 1 and head[0]["block_size"] == {"int8": 64, "int4": 32}[precision]
    assert {(m["K"], m["block_size"]) for m in q if m not in head} == {"int8": {(64, 64), (256, 128)},
                                                                       "int4": {(64, 64), (256, 64)}}[precision]
    # int4 carries a zero point per block (quantize_asymmetric); int8 is ONNX Runtime's symmetric quantizer's
    nodes = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert {len(n.input) for n in nodes} == {"int8": {3}, "int4": {4}}[precision]
    inits = {t.name: t for t in model.graph.initializer}
    # no float MatMul with a constant weight is left; the embedding Gather still reads the float32 table
    assert not [n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in inits]
    gathers = [n for n in model.graph.node if n.op_type == "Gather" and n.input[0] == "wte.weight"]
    assert len(gathers) == 1 and inits["wte.weight"].data_type == onnx.TensorProto.FLOAT
    assert TIED_HEAD not in inits  # the folded copy was quantized, not kept in float
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["andrea.precision"] == precision and "andrea.config" in meta


@pytest.mark.parametrize("precision", WEIGHT_ONLY)
def test_engine_qdq_graphs_are_in_the_form_tensorrt_imports(tiny_onnx, tmp_path, precision):
    """The engines' Q/DQ graph: int8 per output column (TensorRT block-dequantizes INT4 only), int4 in blocks
    of 32, every scale positive, each weight within its quantization step of the fp32 weight, and nothing
    TensorRT's import rules refuse (the old graph, int8 in blocks of 64 with int4's signed scales, broke two)."""
    from andrea_export.engine.onnx_rules import tensorrt_import_problems

    qdq = onnx.load(str(write_qdq(tiny_onnx, tmp_path / f"model.{precision}.qdq.onnx", precision)))
    assert tensorrt_import_problems(qdq) == []
    assert not [n for n in qdq.graph.node if n.domain == "com.microsoft"]
    assert {p.key: p.value for p in qdq.metadata_props}["andrea.precision"] == precision
    inits = {t.name: t for t in qdq.graph.initializer}
    fp32 = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(tiny_onnx)).graph.initializer}
    dq = [n for n in qdq.graph.node if n.op_type == "DequantizeLinear"]
    assert sorted(tuple(inits[n.input[0]].dims) for n in dq) == TINY_MATMULS
    for n in dq:
        a = {x.name: onnx.helper.get_attribute_value(x) for x in n.attribute}
        q = onnx.numpy_helper.to_array(inits[n.input[0]]).astype(np.float32)
        s = onnx.numpy_helper.to_array(inits[n.input[1]])
        assert (s > 0).all()
        if precision == "int8":
            assert inits[n.input[0]].data_type == onnx.TensorProto.INT8 and a == {"axis": 1} and s.shape == (q.shape[1],)
            step = np.broadcast_to(s, q.shape)
        else:
            assert inits[n.input[0]].data_type == onnx.TensorProto.INT4 and a == {"axis": 0, "block_size": 32}
            step = np.repeat(s, 32, axis=0)
        src = n.input[0].removesuffix(f"_q{QUANT[precision]['bits']}")
        ref = fp32[src] if src in fp32 else fp32["wte.weight"].T
        # round to nearest: half a step; int4's searched scale may clip a block's positive extreme by one step
        assert (np.abs(q * step - ref) <= step * (0.5 if precision == "int8" else 1.0) * 1.0001).all(), n.name
    ids = np.random.default_rng(0).integers(0, ANDREA_TINY.vocab_size, (2, 32))
    ref = _run(tiny_onnx, ids)
    assert np.abs(_run(tmp_path / f"model.{precision}.qdq.onnx", ids, qdq_accuracy_level=0) - ref).max() < \
        {"int8": 0.05, "int4": 0.5}[precision] * np.abs(ref).max()


def test_int4_scale_search_beats_plain_rounding_and_keeps_scales_positive():
    """quantize_symmetric's int4 scales: never above plain amax / 7 rounding's squared error (that scale is
    one of the candidates), clearly below it on Gaussian weights, and positive for an all-zero block."""
    from andrea_export.graphs.quantize import quantize_symmetric

    w = np.random.default_rng(0).normal(0, 0.02, (256, 64)).astype(np.float32)
    w[:32, 0] = 0.0  # one all-zero block
    q, s = quantize_symmetric(w, 4, 32)
    assert s.shape == (8, 64) and (s > 0).all() and q.min() >= -8 and q.max() <= 7
    err = ((q * np.repeat(s, 32, axis=0) - w) ** 2).reshape(8, 32, 64).sum(axis=1)
    g = w.reshape(8, 32, 64)
    s7 = np.where(np.abs(g).max(axis=1) > 0, np.abs(g).max(axis=1) / 7, 1.0)
    err7 = ((np.clip(np.rint(g / s7[:, None]), -8, 7) * s7[:, None] - g) ** 2).sum(axis=1)
    assert (err <= err7 * (1 + 1e-6)).all() and err.sum() < 0.9 * err7.sum()
    q8, s8 = quantize_symmetric(w, 8, None)
    assert s8.shape == (64,) and (s8 > 0).all() and np.abs(q8).max() == 127


def test_int4_asymmetric_blocks_beat_min_max_and_keep_zero_exact():
    """quantize_asymmetric: integers in [0, 15], positive scales, zero exact in every block (an all-zero block
    and a constant one come back as they were), and a squared error never above plain min-max rounding's (the
    unshrunk range is a candidate), clearly below it on Gaussian weights."""
    from andrea_export.graphs.quantize import quantize_asymmetric

    w = np.random.default_rng(0).normal(0, 0.02, (256, 64)).astype(np.float32)
    w[:64, 0], w[:64, 1] = 0.0, 0.03  # an all-zero block, a constant block
    q, s, z = quantize_asymmetric(w, 4, 64)
    assert q.dtype == z.dtype == np.uint8 and q.max() <= 15 and z.max() <= 15 and s.shape == z.shape == (4, 64)
    assert (s > 0).all()
    deq = (q.astype(np.float32) - np.repeat(z, 64, axis=0)) * np.repeat(s, 64, axis=0)
    np.testing.assert_array_equal(deq[:64, 0], 0.0)
    np.testing.assert_allclose(deq[:64, 1], 0.03, rtol=1e-6)
    g = w.reshape(4, 64, 64)
    lo, hi = np.minimum(g.min(1), 0), np.maximum(g.max(1), 0)
    sm = np.where(hi > lo, (hi - lo) / 15, 1.0)[:, None]
    zm = np.clip(np.rint(-lo[:, None] / sm), 0, 15)
    err_mm = (((np.clip(np.rint(g / sm) + zm, 0, 15) - zm) * sm - g) ** 2).sum(1)
    err = ((deq.reshape(4, 64, 64) - g) ** 2).sum(1)
    assert (err <= err_mm * (1 + 1e-5)).all() and err.sum() < 0.95 * err_mm.sum()


def test_gptq_keeps_a_layers_output_where_rounding_keeps_its_weights():
    """quantize_gptq: quantize_asymmetric's format; with isotropic inputs (E[x x^T] = I: no error worth pushing
    on) exactly its rounding; with inputs that carry a mean and correlations, as a model's layers do, an output
    error on inputs it never saw far below rounding's, at the same bytes."""
    from andrea_export.graphs.quantize import quantize_asymmetric, quantize_gptq, quantize_symmetric

    rng = np.random.default_rng(0)
    k, n, block = 256, 48, 64
    w = rng.normal(0, 0.02, (k, n)).astype(np.float32)
    rounded = quantize_asymmetric(w, 4, block)
    for a, b in zip(quantize_gptq(w, np.eye(k), 4, block), rounded):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    q, s, z = quantize_gptq(w, np.eye(k), 4, 32, form="symmetric")  # the engines' form: TensorRT's symmetric blocks
    for a, b in zip((q, s), quantize_symmetric(w, 4, 32)):
        np.testing.assert_array_equal(a, b)
    assert q.dtype == np.int8 and not z.any()
    mix, mean = rng.normal(0, 1, (k, k)) / np.sqrt(k), rng.normal(0, 1, k)

    def inputs(rows):
        return rng.normal(0, 1, (rows, k)) @ mix + mean

    x = inputs(2048)
    q, s, z = quantize_gptq(w, x.T @ x / len(x), 4, block)
    assert q.dtype == z.dtype == np.uint8 and q.max() <= 15 and z.max() <= 15 and (s > 0).all()

    def output_error(q, s, z):
        deq = (q.astype(np.float32) - np.repeat(z, block, axis=0)) * np.repeat(s, block, axis=0)
        assert np.abs(deq - w).max() < 0.05  # still these weights, not another's
        unseen = inputs(2048)
        return float(((unseen @ (deq - w)) ** 2).sum())

    assert output_error(q, s, z) < 0.5 * output_error(*rounded)


def test_int4_weights_solved_once_serve_every_graph_and_keep_the_model(tiny_model, tiny_onnx, lively_model, tmp_path):
    """solve_int4 on the standard graph: every weight MatMul solved in both of int4's forms, and the in-place
    decoder (another export of the same weights) takes the same integers. On the trained demo, whose layers'
    inputs are far from isotropic, the solved int4 graphs keep the next-token distribution on random ids (not the
    calibration's) several times closer than rounding does (measured, the head at 4 bits: KL 0.0005 against
    0.0087 for MatMulNBits, 0.0004 against 0.0080 for the engines' Q/DQ form)."""
    from andrea_export.graphs.export import export_onnx
    from andrea_export.graphs.inplace_decoder import export_inplace_decoder
    from andrea_export.graphs.quantize import _kl, solve_int4

    solved = solve_int4(tiny_onnx)
    assert len(solved) == 2 * len(TINY_MATMULS)

    def weights(path, op):  # the integers of every quantized weight, in no particular order
        model = onnx.load(str(path))
        inits = {t.name: t for t in model.graph.initializer}
        weight = {"MatMulNBits": 1, "DequantizeLinear": 0}[op]
        return sorted(onnx.numpy_helper.to_array(inits[n.input[weight]]).tobytes()
                      for n in model.graph.node if n.op_type == op)

    decoder = export_inplace_decoder(tiny_model, tmp_path / "decoder.inplace.onnx", quiet=True)
    for op, write in (("MatMulNBits", quantize_weights), ("DequantizeLinear", write_qdq)):
        standard = weights(write(tiny_onnx, tmp_path / f"model.{op}.onnx", "int4", solved=solved), op)
        assert weights(write(decoder, tmp_path / f"decoder.{op}.onnx", "int4", solved=solved), op) == standard
        assert weights(write(tiny_onnx, tmp_path / f"rounded.{op}.onnx", "int4"), op) != standard

    trained = export_onnx(lively_model, tmp_path / "lively.onnx", quiet=True)
    ids = np.random.default_rng(5).integers(0, ANDREA_TINY.vocab_size, (8, 64))
    ref, solved = _run(trained, ids), solve_int4(trained)
    for write, factor in ((quantize_weights, 0.2), (write_qdq, 0.2)):
        kl = {name: _kl(ref, _run(write(trained, tmp_path / f"lively.{name}.onnx", "int4", 4, got), ids, 0))
              for name, got in (("rounded", None), ("solved", solved))}
        assert kl["solved"] < factor * kl["rounded"], (write.__name__, kl)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k", [64, 96])  # 96 = 3 blocks of 32: a column's odd block count pads its zero points
def test_matmulnbits_packing_is_what_onnx_runtime_computes(bits, k):
    """One MatMulNBits node from quantize_asymmetric + pack_nbits, run by ONNX Runtime without activation
    quantization (accuracy level 0): x @ the dequantized weight. A swapped nibble, a transposed block or a
    misplaced zero point would not be."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from andrea_export.graphs.quantize import pack_nbits, quantize_asymmetric

    rng = np.random.default_rng(1)
    n, block = 40, 32
    w = rng.normal(0, 0.02, (k, n)).astype(np.float32)
    q, s, z = quantize_asymmetric(w, bits, block)
    packed, zeros = pack_nbits(q, z, bits, block)
    node = helper.make_node("MatMulNBits", ["x", "B", "S", "Z"], ["y"], domain="com.microsoft", K=k, N=n, bits=bits,
                            block_size=block, accuracy_level=0)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, n])],
                              [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(np.ascontiguousarray(s.T).reshape(-1), "S"),
                               numpy_helper.from_array(zeros, "Z")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    x = rng.normal(0, 1, (3, k)).astype(np.float32)
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    deq = (q.astype(np.float32) - np.repeat(z, block, axis=0)) * np.repeat(s, block, axis=0)
    np.testing.assert_allclose(y, x @ deq, rtol=1e-4, atol=1e-5)
    assert np.abs(deq - w).max() < 0.02  # and the weights are the model's, not another's


def test_the_int4_head_goes_to_8_bits_where_its_error_sits(lively_model, tmp_path):
    """choose_head_bits: on the trained demo the tied head alone makes most of int4's error (measured 73 %:
    8 bits; ANDREA-120M's seeded weights, too large for this suite, measured 10 %: 4 bits), and the share is
    compared with the bound it is given. The int4 graph and its engine twin then quantize the head as chosen:
    MatMulNBits at 8 bits, Q/DQ int8 per column."""
    from andrea_export.graphs.export import export_onnx
    from andrea_export.graphs.quantize import choose_head_bits

    trained = export_onnx(lively_model, tmp_path / "model.onnx", quiet=True)
    bits, share = choose_head_bits(trained)
    assert bits == 8 and 0.6 < share < 0.9, share
    assert choose_head_bits(trained, share=0.95) == (4, share)
    heads = [m for m in matmulnbits(onnx.load(str(quantize_weights(trained, tmp_path / "m.int4.onnx", "int4", 8))))
             if m["N"] == ANDREA_TINY.vocab_size]
    assert [(h["bits"], h["block_size"]) for h in heads] == [(8, 64)]
    qdq = onnx.load(str(write_qdq(trained, tmp_path / "m.int4.qdq.onnx", "int4", 8)))
    inits = {t.name: t for t in qdq.graph.initializer}
    assert inits[f"{TIED_HEAD}_q8"].data_type == onnx.TensorProto.INT8


def test_bad_combinations_are_refused(tiny_onnx, tmp_path):
    assert set(WEIGHT_ONLY) <= set(PRECISIONS)
    with pytest.raises(ConfigError, match="weight-only precision must be one of int8, int4"):
        quantize_weights(tiny_onnx, tmp_path / "x.onnx", "int2")
    int4 = quantize_weights(tiny_onnx, tmp_path / "model.int4.onnx", "int4")
    with pytest.raises(ExportError, match="already a int4 graph; quantize the fp32 export"):
        quantize_weights(int4, tmp_path / "again.onnx", "int8")
    with pytest.raises(ConfigError, match="the tied head is quantized at 4 or 8 bits, not 6"):
        quantize_weights(tiny_onnx, tmp_path / "h6.onnx", "int4", head_bits=6)
    odd = ModelConfig(name="odd", vocab_size=64, n_embd=48, n_layer=1, n_head=4, n_positions=16)
    for precision in WEIGHT_ONLY:
        with pytest.raises(ConfigError, match=f"blocks of 16 to {QUANT[precision]['block_size']} along n_embd; odd's n_embd = 40 is not a multiple of 16"):
            check_model_shape(ModelConfig(name="odd", vocab_size=64, n_embd=40, n_layer=1, n_head=4, n_positions=16), precision)
    check_model_shape(odd, "int8")  # 48 = 3 x 16: blocks of 16
    assert [block_for(k, "int4") for k in (48, 64, 256, 768, 3072, 40)] == [16, 64, 64, 64, 64, None]
    assert [block_for(k, "int4", head=True) for k in (48, 64, 768)] == [16, 32, 32]
    check_model_shape(odd, "fp16")  # float precisions have no blocks


def test_cli_refuses_an_unknown_precision(tmp_path):
    result = CliRunner().invoke(main, ["build", "--config", "andrea-tiny", "--precision", "int2", "--out", str(tmp_path / "b")])
    assert result.exit_code == 2 and "int8" in result.output and "int4" in result.output


@pytest.fixture(scope="module", params=WEIGHT_ONLY)
def quantized_build(request, demo_dir, tmp_path_factory):
    """The trained demo model built weight-only, with its tokenizer, held-out text and decoder."""
    pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX (the 'rtx' extra) builds the engines on a CPU")
    from andrea_export.pipeline import BuildOptions, run_build

    out = tmp_path_factory.mktemp("build") / f"demo-{request.param}"
    opts = BuildOptions(checkpoint=str(demo_dir / "model.safetensors"), builder="tensorrt-rtx",
                        precision=request.param, tokenizer=str(demo_dir / "tokenizer.json"),
                        eval_text=str(demo_dir / "heldout.txt"), out=str(out), greedy_steps=4,
                        verify_shapes=[[2, 32]])
    return request.param, out, run_build(opts)


def test_quantized_build_verifies_with_its_figures_in_verify_json(quantized_build):
    precision, out, manifest = quantized_build
    report = json.loads((out / "verify.json").read_text())
    assert manifest["status"] == "engine-unverified", report["comparisons"]  # no GPU here for the engine
    assert manifest["precision"] == report["precision"] == precision
    a = {k: v["path"] for k, v in manifest["artifacts"].items()}
    assert a["onnx"] == f"model.{precision}.onnx" and a["decoder_onnx"] == f"decoder.{precision}.onnx"
    assert a["onnx_qdq"] == f"model.{precision}.qdq.onnx" and a["decoder_onnx_qdq"] == f"decoder.{precision}.qdq.onnx"
    assert a["weights"] == f"weights.{precision}.data"
    assert manifest["builder"]["source_graph"] == a["onnx_qdq"]  # the engine is built from the Q/DQ graph
    how = manifest["quantization"]  # how the weights were made, and what the head measured
    if precision == "int8":
        assert how == {"method": "round-to-nearest"}
    else:
        assert how["method"] == "gptq" and how["calibration"]["ids"] == "random" and how["head_bits"] == 4
        assert 0.2 < how["head_error_share"] < 0.5, how  # measured 0.40: below HEAD_SHARE, so 4 bits
    # (bits, block, accuracy level): int8 in blocks of 128 (64 where K = 64); int4's body in blocks of 64, and the
    # trained demo's head in 32: GPTQ-solved (solve_int4) it makes 40 % of int4's error, not most (choose_head_bits)
    want = {"int8": {(8, 64, 4), (8, 128, 4)}, "int4": {(4, 64, 4), (4, 32, 4)}}[precision]
    for graph in (a["onnx"], a["decoder_onnx"], a["decoder_onnx_inplace"]):
        assert {(m["bits"], m["block_size"], m["accuracy_level"]) for m in matmulnbits(onnx.load(str(out / graph)))} == want
    assert report["perplexity"]["computed"] and report["perplexity"]["max_rel_diff"] == MAX_PPL_REL[precision]
    assert {c["artifact"] for c in report["comparisons"]} == {"onnxrt", "onnxrt-plugin"}
    for c in report["comparisons"]:
        assert c["passed"], c
        assert abs(c["perplexity"]["rel_diff"]) <= {"int8": 0.01, "int4": 0.05}[precision]  # the issue's goals
        s = c["shapes"][0]
        assert {"top1_agreement", "top5_overlap", "max_kl"} <= set(s)
        assert s["max_kl"] > 0  # quantized: not the fp32 graph under another name
    assert report["decoder"]["passed"] and report["decoder"]["artifact"] == a["decoder_onnx"]
    # the slot decoder is TensorRT's: the Q/DQ form (no MatMulNBits), checked step by step as TensorRT computes it
    slots = a["decoder_onnx_slots"]
    assert slots == f"decoder.{precision}.qdq.slots.onnx" and not matmulnbits(onnx.load(str(out / slots)))
    assert report["decoder"]["slots"]["artifact"] == slots and report["decoder"]["slots"]["passed"]
    weights = report["engine_weights"]  # each engine against its Q/DQ graph: too small a model to judge by size
    assert set(weights) == {"engine", "decoder_engine"}
    assert weights["engine"]["graph"] == a["onnx_qdq"] and weights["decoder_engine"]["graph"] == a["decoder_onnx_qdq"]
    assert all(w["passed"] and not w["judged"] and w["quantized_weights"] > 0 for w in weights.values())


@pytest.mark.parametrize("quantized_build", ["int4"], indirect=True)  # the int4 build only: no skipped twin
def test_generate_runs_on_the_int4_decoder(quantized_build, lively_prompt):
    """generate decodes with the int4 KV-cache decoder, token for token what the int4 standard graph
    picks when it recomputes everything (the same quantized weights, no cache)."""
    from andrea_export import runtime

    precision, out, manifest = quantized_build
    result = CliRunner().invoke(main, ["generate", str(out), "--prompt", "The for statement", "-n", "12",
                                       "--backend", "onnxruntime"])
    assert result.exit_code == 0, result.output
    assert len(result.output.split("\n", 1)[0].split()) == 12
    with runtime.load(out, "onnxruntime") as session:
        assert Path(session.source).name == "decoder.int4.inplace.onnx"  # ONNX Runtime runs the in-place graph
        tokens = session.generate(lively_prompt, 16)
    ids = np.array([lively_prompt], dtype=np.int64)
    for _ in range(16):
        ids = np.concatenate([ids, _run(out / "model.int4.onnx", ids)[:, -1:].argmax(-1)], axis=1)
    assert tokens == ids[0, len(lively_prompt):].tolist()
    assert len(set(tokens)) > 3  # it really decodes text, not one repeated token



def test_a_gguf_of_a_weight_only_build_is_at_its_precision_unless_told(quantized_build, tmp_path):
    """`package --gguf` on a weight-only build writes its precision's type (an int4 user expects int4's bytes,
    not f16's four times as many): q4_0 (GPTQ-solved, as the build's int4 is), q8_0 for int8; --gguf-type still
    chooses."""
    gguf = pytest.importorskip("gguf", reason="the 'gguf' extra (ggml's gguf package) writes and reads the file")
    precision, out, _ = quantized_build
    result = CliRunner().invoke(main, ["package", str(out), "--gguf", str(tmp_path / "m.gguf")])
    assert result.exit_code == 0, result.output
    want = {"int4": gguf.GGMLQuantizationType.Q4_0, "int8": gguf.GGMLQuantizationType.Q8_0}[precision]
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    assert types["blk.0.ffn_up.weight"] == want and types["token_embd.weight"] == gguf.GGMLQuantizationType.Q8_0
    result = CliRunner().invoke(main, ["package", str(out), "--gguf", str(tmp_path / "f.gguf"), "--gguf-type", "f32"])
    assert result.exit_code == 0, result.output
    assert {t.tensor_type for t in gguf.GGUFReader(tmp_path / "f.gguf").tensors} == {gguf.GGMLQuantizationType.F32}

@pytest.mark.parametrize("precision", WEIGHT_ONLY)
def test_turing_is_refused_for_weight_only(precision):
    """The int8/int4 engines multiply float32 activations, which TensorRT-RTX cannot do for Turing."""
    from andrea_export.engine.compat import check_targets

    with pytest.raises(ConfigError, match="TensorRT-RTX builds no fp32 matrix multiplies for compute capability 7.5"):
        check_targets("tensorrt-rtx", ["7.5"], precision)


def test_verification_runs_the_qdq_graph_as_the_engine_computes_it(tiny_onnx, tmp_path):
    """verify's ONNX Runtime runner keeps a Q/DQ graph's activations float32 (ORT would otherwise fuse it
    into a MatMulNBits that quantizes them to int8), so it measures the weights the engine gets."""
    from andrea_export.verify.compare import onnxrt_runner

    nbits = quantize_weights(tiny_onnx, tmp_path / "model.int4.onnx", "int4")
    qdq = write_qdq(tiny_onnx, tmp_path / "model.int4.qdq.onnx", "int4")
    ids = np.random.default_rng(1).integers(0, ANDREA_TINY.vocab_size, (2, 32))
    runner = onnxrt_runner(qdq)
    with runner:
        got = runner.infer({"input_ids": ids})["logits"]
    np.testing.assert_allclose(got, _run(qdq, ids, qdq_accuracy_level=0), atol=1e-5, rtol=1e-5)
    assert not np.allclose(got, _run(nbits, ids), atol=1e-4, rtol=1e-4)  # ONNX Runtime's int8 x int8 nodes differ


@pytest.mark.parametrize("quantized_build", ["int8"], indirect=True)  # one weight-only build is enough here
def test_verify_cli_reverifies_a_quantized_build_with_its_decoder(quantized_build, demo_dir):
    """`verify BUILD` re-measures the folder and prints its summary, the KV-cache decoder's line included
    (that line concatenated a str and a rich Text: a TypeError for every build with a decoder). 32 positions:
    at 8, one top-1 flip at a near-tie is 12.5 % and fails int8's 90 % floor (it did, on the demo as trained
    on an Intel Xeon, whose rounding differs from the AMD EPYC's)."""
    precision, out, _ = quantized_build
    result = CliRunner().invoke(main, ["verify", str(out), "--checkpoint", str(demo_dir / "model.safetensors"),
                                       "--shapes", "1x32", "--greedy-steps", "2"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert "KV-cache decoder decoder.int8.onnx" in result.output and "perplexity on" in result.output


def _nibbles_swapped(graph: Path, out: Path) -> Path:
    """The int4 graph with the two 4-bit weights of every byte exchanged: a packing bug that runs without error."""
    from onnx import numpy_helper

    model = onnx.load(str(graph))
    packed = {n.input[1] for n in model.graph.node if n.op_type == "MatMulNBits"}
    for t in model.graph.initializer:
        if t.name in packed:
            a = numpy_helper.to_array(t)
            t.CopyFrom(numpy_helper.from_array(((a >> 4) | (a << 4)).astype(a.dtype), t.name))
    onnx.save(model, str(out))
    return out


def test_the_int4_next_token_floor_passes_int4_and_fails_a_broken_int4(lively_model, tmp_path):
    """On the trained model at verify's default shapes, the int4 graph meets int4's top-k floor at every shape,
    and the int4 graph with its nibbles swapped misses it at every shape of more than one token (with the KL
    bound set aside: the floor must catch it by itself)."""
    import torch

    from andrea_export.graphs.export import export_onnx
    from andrea_export.verify.compare import default_shapes, lm_metrics, lm_passed, lm_thresholds

    good = quantize_weights(export_onnx(lively_model, tmp_path / "model.onnx", quiet=True),
                            tmp_path / "model.int4.onnx", "int4")
    broken = _nibbles_swapped(good, tmp_path / "broken.int4.onnx")
    floor = {**lm_thresholds("int4"), "max_kl": float("inf")}
    rng = np.random.default_rng(0)
    for shape in default_shapes(lively_model.cfg.n_positions):
        ids = rng.integers(0, lively_model.cfg.vocab_size, size=shape, dtype=np.int64)
        with torch.no_grad():
            ref = lively_model(torch.from_numpy(ids)).numpy()
        tie = lm_thresholds("int4")["top5_tie"]  # the near-ties int4 is forgiven do not hide a broken graph
        assert lm_passed(lm_metrics(ref, _run(good, ids), top5_tie=tie), lm_thresholds("int4")), shape
        if shape[1] > 1:
            assert not lm_passed(lm_metrics(ref, _run(broken, ids), top5_tie=tie), floor), shape

"""llama.cpp as a bench peer (bench/backends/llama_cpp.py): where llama-cpp-python is installed, the f32 GGUF of
the bench's own weights generates, through llama.cpp's batch API, the greedy tokens our runtime generates, row by
row at batch 3, and its prefill gives our logits; its quantized files are llama.cpp's own quantizer's. Elsewhere
the peer is skipped with the reason (what a bench run reports)."""

import importlib.util

import numpy as np
import pytest

from andrea_export import bench
from andrea_export.config import ANDREA_TINY


def test_without_llama_cpp_the_peer_says_why():
    backends = bench.make_backends(["llama-cpp", "llama-cpp-q8_0", "llama-cpp-q4_0"])
    assert [(b.name, b.precision) for b in backends] == [("llama-cpp", "fp32"), ("llama-cpp-q8_0", "int8"),
                                                         ("llama-cpp-q4_0", "int4")]
    if importlib.util.find_spec("llama_cpp") is None:
        assert all("'llama_cpp' is not installed (pip install llama-cpp-python" in b.check() for b in backends)
    with pytest.raises(ValueError, match="kind must be one of f32, q8_0, q4_0"):
        bench.LlamaCppBackend("q3_k")


def test_llama_cpp_generates_our_tokens_from_the_same_weights(tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python compiles llama.cpp from source (about 12 minutes on 2 "
                        "cores): not installed by `make setup`; `pip install llama-cpp-python`")
    pytest.importorskip("gguf", reason="the 'gguf' extra writes the GGUF file")
    from andrea_export.bench.work import case_inputs
    from andrea_export.model.checkpoint import random_init

    ctx = bench.Context(random_init(ANDREA_TINY, seed=0, announce=False), 2, tmp_path / "cache")
    ours, f32, q4 = bench.OrtBackend(), bench.LlamaCppBackend("f32"), bench.LlamaCppBackend("q4_0")
    for b in (ours, f32, q4):
        assert b.check() is None
        b.setup(ctx)
        b.prepare(["prefill", "generate"])
    prompt = case_inputs(ANDREA_TINY, "generate", 3, 16, 0, seed=1)[0]
    theirs = f32.generate(prompt, 12)()
    assert theirs.tolist() == ours.generate(prompt, 12)()
    logits = f32.prefill(prompt)().reshape(3, 16, -1)
    import torch

    with torch.no_grad():
        reference = ctx.model(torch.from_numpy(prompt)).numpy()
    np.testing.assert_allclose(logits, reference, atol=1e-3, rtol=1e-3)
    import gguf

    # llama-quantize's Q4_0 mix: the tied embedding / output at Q6_K, which needs rows of 256: andrea-tiny's 64 get Q8_0
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(q4.path).tensors}
    assert types["token_embd.weight"] == "Q8_0" and types["blk.0.ffn_up.weight"] == "Q4_0"
    assert q4.generate(prompt, 12)().shape == (3, 12)

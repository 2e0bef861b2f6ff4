import math

import pytest
import torch
import torch.nn.functional as F

from andrea_export.config import ANDREA_120M, ANDREA_TINY
from andrea_export.model.andrea import Andrea
from andrea_export.model.checkpoint import random_init


def test_andrea_120m_has_92_331_264_parameters():
    model = Andrea(ANDREA_120M)
    assert model.n_params() == 92_331_264 == ANDREA_120M.n_params
    layer_norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert len(layer_norms) == 25


def test_output_projection_is_the_token_embedding(tiny_model):
    x = torch.randn(1, 3, ANDREA_TINY.n_embd)
    # the logits are ln_f(x) @ wte^T: no separate lm_head parameter exists
    assert not any("lm_head" in n for n, _ in tiny_model.named_parameters())
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        h = tiny_model.wte(ids) + tiny_model.wpe(torch.arange(3))
        for b in tiny_model.h:
            h = b(h)[0]
        expected = tiny_model.ln_f(h) @ tiny_model.wte.weight.t()
        assert torch.allclose(tiny_model(ids), expected)
    assert x.shape[-1] == ANDREA_TINY.n_embd


def test_gelu_is_the_tanh_approximation(tiny_model):
    x = torch.linspace(-6, 6, 101)
    reference = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    gelu = tiny_model.h[0].mlp.gelu
    assert torch.allclose(gelu(x), reference, atol=1e-6)
    assert not torch.allclose(gelu(x), F.gelu(x), atol=1e-5)  # differs from the erf form


def test_attention_is_causal(tiny_model):
    ids = torch.randint(0, ANDREA_TINY.vocab_size, (1, 10))
    changed = ids.clone()
    changed[0, 7] = (ids[0, 7] + 1) % ANDREA_TINY.vocab_size
    with torch.no_grad():
        a, b = tiny_model(ids), tiny_model(changed)
    assert torch.equal(a[0, :7], b[0, :7])  # earlier positions do not see the later token
    assert not torch.allclose(a[0, 7:], b[0, 7:])


def test_kv_cache_step_matches_full_forward(tiny_model):
    ids = torch.randint(0, ANDREA_TINY.vocab_size, (2, 12))
    with torch.no_grad():
        full = tiny_model(ids)
        logits, past = tiny_model.forward_with_cache(ids[:, :9])
        step, _ = tiny_model.forward_with_cache(ids[:, 9:], past)
    assert torch.allclose(torch.cat([logits, step], 1), full, atol=1e-5)


def test_left_padding_does_not_change_real_tokens(tiny_model):
    ids = torch.randint(0, ANDREA_TINY.vocab_size, (1, 6))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        plain = tiny_model(ids)
        masked, _ = tiny_model.forward_with_cache(padded, key_mask=mask)
    assert torch.allclose(masked[:, 3:], plain, atol=1e-5)


def test_random_init_is_seeded_and_announced(capsys):
    a = random_init(ANDREA_TINY, seed=1)
    b = random_init(ANDREA_TINY, seed=1, announce=False)
    c = random_init(ANDREA_TINY, seed=2, announce=False)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.wte.weight, c.wte.weight)
    assert "RANDOM weights (seed 1)" in capsys.readouterr().err
    assert a.wte.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert a.weights_source == {"kind": "random-init", "seed": 1}

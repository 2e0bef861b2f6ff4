import pytest
import torch
from safetensors.torch import save_file

from andrea_export.config import ANDREA_TINY
from andrea_export.errors import CheckpointError
from andrea_export.model.checkpoint import load_checkpoint, load_model, save_checkpoint


def _gpt2_layout(model, prefix="transformer.", with_head=True):
    """The model's weights as a Hugging Face GPT-2 file holds them: Conv1D weights transposed, mask buffers."""
    out = {}
    for k, v in model.state_dict().items():
        if k.endswith(("c_attn.weight", "attn.c_proj.weight", "c_fc.weight", "mlp.c_proj.weight")):
            v = v.t()
        out[prefix + k] = v.contiguous().clone()
    out[prefix + "h.0.attn.bias"] = torch.ones(1, 1, 128, 128)  # old GPT-2 files keep the mask
    if with_head:
        out["lm_head.weight"] = model.wte.weight.detach().clone()
    return out


def _same(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


def test_save_and_load_round_trip(tiny_model, tmp_path):
    path = save_checkpoint(tiny_model, tmp_path / "w.safetensors")
    loaded = load_checkpoint(path)
    assert loaded.cfg == ANDREA_TINY  # read from the file's metadata
    assert _same(loaded, tiny_model)
    assert loaded.weights_source["kind"] == "checkpoint" and len(loaded.weights_source["sha256"]) == 64
    assert not list(tmp_path.glob("*.partial"))


@pytest.mark.parametrize("prefix", ["transformer.", ""])
def test_gpt2_layout_is_transposed_and_config_inferred(tiny_model, tmp_path, prefix):
    path = tmp_path / "gpt2.safetensors"
    save_file(_gpt2_layout(tiny_model, prefix), str(path))
    loaded = load_checkpoint(path, ANDREA_TINY)
    assert _same(loaded, tiny_model)
    with torch.no_grad():
        ids = torch.randint(0, ANDREA_TINY.vocab_size, (1, 5))
        assert torch.equal(loaded(ids), tiny_model(ids))


def test_gpt2_config_inferred_from_shapes(tmp_path):
    from andrea_export.config import ModelConfig
    from andrea_export.model.checkpoint import random_init

    cfg = ModelConfig(name="x", vocab_size=300, n_embd=768, n_layer=1, n_head=12, n_positions=32)
    model = random_init(cfg, announce=False)
    path = tmp_path / "gpt2-small-ish.safetensors"
    save_file(_gpt2_layout(model), str(path))
    loaded = load_checkpoint(path)
    assert (loaded.cfg.vocab_size, loaded.cfg.n_embd, loaded.cfg.n_layer, loaded.cfg.n_head,
            loaded.cfg.n_positions) == (300, 768, 1, 12, 32)


def test_heads_ambiguous_needs_a_config(tiny_model, tmp_path):
    path = tmp_path / "g.safetensors"
    save_file(_gpt2_layout(tiny_model), str(path))
    with pytest.raises(CheckpointError, match=r"number of attention heads cannot be inferred from tensor shapes "
                       r"\(width 64 is not a GPT-2 size\); put the model's config.json beside it, or pass a config file "
                       r"with 'n_head' \(--config\)"):
        load_checkpoint(path)


def test_missing_and_unexpected_tensors_are_named(tiny_model, tmp_path):
    state = dict(tiny_model.state_dict())
    del state["h.1.mlp.c_fc.bias"]
    state["h.0.extra"] = torch.zeros(3)
    path = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path, ANDREA_TINY)
    assert "missing tensor(s): h.1.mlp.c_fc.bias" in str(e.value)
    assert "unexpected tensor(s): h.0.extra" in str(e.value)


def test_wrong_shape_is_named(tiny_model, tmp_path):
    state = {k: v.contiguous() for k, v in tiny_model.state_dict().items()}
    state["wpe.weight"] = torch.zeros(64, 64)
    path = tmp_path / "w.safetensors"
    save_file(state, str(path))
    with pytest.raises(CheckpointError, match=r"tensor 'wpe.weight' has shape \[64, 64\], expected \[128, 64\]"):
        load_checkpoint(path, ANDREA_TINY)


def test_nan_is_named(tiny_model, tmp_path):
    state = {k: v.contiguous().clone() for k, v in tiny_model.state_dict().items()}
    state["h.0.ln_1.weight"][3] = float("nan")
    path = tmp_path / "w.safetensors"
    save_file(state, str(path))
    with pytest.raises(CheckpointError, match=r"tensor 'h.0.ln_1.weight' contains 1 NaN/Inf value\(s\)"):
        load_checkpoint(path, ANDREA_TINY)


def test_untied_head_is_refused(tiny_model, tmp_path):
    state = _gpt2_layout(tiny_model)
    state["lm_head.weight"] = state["lm_head.weight"] + 1
    path = tmp_path / "w.safetensors"
    save_file(state, str(path))
    with pytest.raises(CheckpointError, match="tensor 'lm_head.weight' differs from 'wte.weight'"):
        load_checkpoint(path, ANDREA_TINY)


def test_truncated_and_foreign_files(tiny_model, tmp_path):
    path = save_checkpoint(tiny_model, tmp_path / "w.safetensors")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="not a readable .safetensors file \\(truncated or another format\\?\\)"):
        load_checkpoint(path)
    other = tmp_path / "notes.safetensors"
    other.write_text("hello, I am not a checkpoint")
    with pytest.raises(CheckpointError, match="not a readable .safetensors file"):
        load_checkpoint(other)
    with pytest.raises(CheckpointError, match="no such checkpoint file"):
        load_checkpoint(tmp_path / "absent.safetensors")


def test_pickles_are_never_unpickled(tiny_model, tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    path = tmp_path / "evil.pt"
    torch.save({"wte.weight": Evil()}, path)
    with pytest.raises(CheckpointError, match=r"cannot be read as a plain tensor state dict with "
                       r"torch.load\(weights_only=True\) \(UnpicklingError"):
        load_checkpoint(path, ANDREA_TINY)


def test_plain_torch_state_dict_loads(tiny_model, tmp_path):
    path = tmp_path / "w.pt"
    torch.save({"state_dict": tiny_model.state_dict()}, path)
    assert _same(load_checkpoint(path, ANDREA_TINY), tiny_model)


def test_integer_tensor_refused(tiny_model, tmp_path):
    state = {k: v.contiguous() for k, v in tiny_model.state_dict().items()}
    state["wpe.weight"] = state["wpe.weight"].long()
    path = tmp_path / "w.safetensors"
    save_file(state, str(path))
    with pytest.raises(CheckpointError, match="tensor 'wpe.weight' has dtype torch.int64; weights must be floating point"):
        load_checkpoint(path, ANDREA_TINY)


def test_load_model_without_checkpoint_is_random_120m_by_default():
    model = load_model(None, ANDREA_TINY, seed=3)
    assert model.weights_source == {"kind": "random-init", "seed": 3}

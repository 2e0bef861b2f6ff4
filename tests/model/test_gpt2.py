"""Hugging Face GPT-2 checkpoints as people have them (save_pretrained folders, sharded, a bare file
with config.json beside it), checked against transformers' own GPT-2: our one reference that shares
none of our model code. Every weight and bias, LayerNorms included, is non-zero and random, so a
loader that drops or misplaces any one of them fails here."""

import json
import shutil

import numpy as np
import pytest
import torch

from andrea_export.errors import CheckpointError
from andrea_export.model.checkpoint import checkpoint_sha256, load_checkpoint

transformers = pytest.importorskip("transformers", reason="transformers (the 'hf' extra)")

SIZE = dict(vocab_size=1000, n_embd=64, n_layer=2, n_head=4, n_positions=128, layer_norm_epsilon=1e-5,
            activation_function="gelu_new")


def _gpt2(**overrides):
    cfg = transformers.GPT2Config(**{**SIZE, **overrides})
    model = transformers.GPT2LMHeadModel(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():  # every weight and bias non-zero; LayerNorm gains near 1
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")) else 0.1 * noise)
    return model


@pytest.fixture(scope="module")
def hf_model():
    return _gpt2()


@pytest.fixture(scope="module")
def hf_folder(hf_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "tiny-gpt2"
    hf_model.save_pretrained(out)
    return out


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


IDS = [[3, 141, 59, 26, 535, 897, 932, 384, 626, 433, 832, 795, 28, 841, 971, 69, 399, 375, 105, 820]]


def test_every_parameter_is_nonzero(hf_model):
    for name, p in hf_model.named_parameters():
        assert (p != 0).all(), name


def test_save_pretrained_folder_builds_and_matches_hugging_face(hf_model, hf_folder, tmp_path):
    """The whole build from the folder; its ONNX graph and KV-cache decoder give Hugging Face's logits."""
    pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX (the 'rtx' extra) builds the engines on a CPU")
    import onnxruntime as ort

    from andrea_export import runtime
    from andrea_export.pipeline import BuildOptions, run_build

    assert {p.name for p in hf_folder.iterdir()} >= {"config.json", "model.safetensors"}
    out = tmp_path / "build"
    manifest = run_build(BuildOptions(checkpoint=str(hf_folder), builder="tensorrt-rtx", out=str(out),
                                      greedy_steps=4, verify_shapes=[[1, 3]]))
    assert manifest["status"] in ("passed", "engine-unverified")
    assert manifest["model"] == {"name": "tiny-gpt2", "vocab_size": 1000, "n_embd": 64, "n_layer": 2, "n_head": 4,
                                 "n_positions": 128, "layer_norm_eps": 1e-5}
    assert manifest["weights"]["sha256"] == checkpoint_sha256(hf_folder)
    want = _hf_logits(hf_model, IDS)
    sess = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    got = sess.run(["logits"], {"input_ids": np.array(IDS, dtype=np.int64)})[0]
    assert np.abs(got - want).max() < 1e-4
    with runtime.load(out, "onnxruntime") as dec:
        assert np.abs(dec.forward(IDS[0]) - want[0]).max() < 1e-4


def test_sharded_folder_and_bare_file_with_config_beside(hf_model, hf_folder, tmp_path):
    sharded = tmp_path / "sharded"
    hf_model.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(hf_folder / "model.safetensors", bare / "weights.safetensors")
    shutil.copy(hf_folder / "config.json", bare / "config.json")
    want = _hf_logits(hf_model, IDS)
    for source in (sharded, bare / "weights.safetensors"):
        model = load_checkpoint(source)
        assert (model.cfg.n_head, model.cfg.n_embd) == (4, 64)  # 64 wide: not inferable from shapes alone
        with torch.no_grad():
            assert (model(torch.tensor(IDS)).numpy() - want).__abs__().max() < 1e-4, source


def test_config_json_changes_what_is_read(hf_folder, tmp_path):
    """layer_norm_epsilon and n_head come from config.json, not from defaults or shapes."""
    folder = tmp_path / "eps"
    shutil.copytree(hf_folder, folder)
    conf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**conf, "layer_norm_epsilon": 1e-3, "n_head": 8}))
    model = load_checkpoint(folder)
    assert (model.cfg.layer_norm_eps, model.cfg.n_head) == (1e-3, 8)
    assert checkpoint_sha256(folder) != checkpoint_sha256(hf_folder)  # the config is part of the checkpoint


@pytest.mark.parametrize("change, match", [
    ({"activation_function": "gelu"}, "activation_function 'gelu' is not the tanh-GELU"),
    ({"activation_function": "relu"}, "activation_function 'relu'"),
    ({"n_inner": 100}, "n_inner = 100"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ({"model_type": "llama"}, "model_type 'llama'"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings false, but there is no 'lm_head.weight'"),
])
def test_configs_ANDREA_cannot_compute_are_refused(hf_folder, tmp_path, change, match):
    folder = tmp_path / "bad"
    shutil.copytree(hf_folder, folder)
    conf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**conf, **change}))
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(folder)


def test_erf_gelu_refused_through_the_cli(tmp_path):
    from click.testing import CliRunner

    from andrea_export.cli import main

    folder = tmp_path / "erf"
    _gpt2(activation_function="gelu").save_pretrained(folder)
    result = CliRunner().invoke(main, ["export", "--checkpoint", str(folder), "--out", str(tmp_path / "m.onnx")])
    assert result.exit_code == 1
    assert "activation_function 'gelu' is not the tanh-GELU" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "m.onnx").exists()


def test_untied_head_is_refused(tmp_path):
    model = _gpt2(tie_word_embeddings=False)
    assert not torch.equal(model.lm_head.weight, model.transformer.wte.weight)
    model.save_pretrained(tmp_path / "untied")
    with pytest.raises(CheckpointError, match="'lm_head.weight' differs from 'wte.weight'"):
        load_checkpoint(tmp_path / "untied")


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd.safetensors", "sub/x.safetensors"])
def test_index_paths_must_stay_inside_the_folder(hf_folder, tmp_path, shard):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    shutil.copy(hf_folder / "config.json", folder)
    shutil.copy(hf_folder / "model.safetensors", tmp_path / "outside.safetensors")  # a real file out there
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"wte.weight": shard}}))
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        load_checkpoint(folder)


def test_index_symlink_out_of_the_folder_is_refused(hf_folder, tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    shutil.copy(hf_folder / "config.json", folder)
    shutil.copy(hf_folder / "model.safetensors", tmp_path / "outside.safetensors")
    (folder / "model-1.safetensors").symlink_to(tmp_path / "outside.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"wte.weight": "model-1.safetensors"}}))
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        load_checkpoint(folder)


def test_folder_without_weights_or_config_is_refused(hf_folder, tmp_path):
    with pytest.raises(CheckpointError, match="needs model.safetensors"):
        load_checkpoint(tmp_path)
    shutil.copy(hf_folder / "model.safetensors", tmp_path)
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "model.safetensors.index.json"])
def test_every_file_of_a_checkpoint_folder_is_refused_when_it_links_out(hf_model, hf_folder, tmp_path, name):
    """One rule for every file read from a checkpoint folder (the index's shards, model.safetensors,
    config.json, the index itself): a symlink resolving outside the folder is refused."""
    folder = tmp_path / "ckpt"
    if name == "model.safetensors.index.json":
        hf_model.save_pretrained(folder, max_shard_size="100KB")
    else:
        shutil.copytree(hf_folder, folder)
    outside = tmp_path / f"outside-{name}"
    (folder / name).rename(outside)
    (folder / name).symlink_to(outside)
    for read in (load_checkpoint, checkpoint_sha256):
        with pytest.raises(CheckpointError, match=f"'{name}' resolves to .*, outside the checkpoint folder"):
            read(folder)


def _hub_cache(source, cache, escape: str | None = None):
    """`source` laid out as the Hugging Face hub cache holds it: models--org--name/blobs/<sha256> and
    snapshots/<revision>/<file> -> ../../blobs/<sha256>. `escape`: that file links out of the repo folder."""
    import hashlib

    repo = cache / "models--org--tiny-gpt2"
    snapshot = repo / "snapshots" / ("0" * 40)
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    for f in sorted(source.iterdir()):
        blob = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, repo / "blobs" / blob)
        target = f"../../blobs/{blob}"
        if f.name == escape:
            shutil.copy(f, cache.parent / f.name)
            target = f"../../../../{f.name}"  # resolves beside the cache, outside the repo folder
        (snapshot / f.name).symlink_to(target)
    return snapshot


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_a_hub_cache_snapshot_loads_and_a_link_out_of_its_repo_is_refused(hf_model, hf_folder, tmp_path, sharded):
    """A hub-cache snapshot (every file a symlink into ../../blobs/) is a normal way to hold a checkpoint: it loads
    as the plain folder does, with the same sha256. A snapshot file that resolves outside the repo folder
    (models--org--name) is refused."""
    source = hf_folder
    if sharded:
        source = tmp_path / "sharded"
        hf_model.save_pretrained(source, max_shard_size="100KB")
    snapshot = _hub_cache(source, tmp_path / "hub" / "cache")
    model = load_checkpoint(snapshot)
    with torch.no_grad():
        np.testing.assert_allclose(model(torch.tensor(IDS)).numpy(), _hf_logits(hf_model, IDS), atol=1e-4, rtol=1e-4)
    assert checkpoint_sha256(snapshot) == checkpoint_sha256(source)
    escaping = "model.safetensors.index.json" if sharded else "config.json"
    bad = _hub_cache(source, tmp_path / "hub2" / "cache", escape=escaping)
    with pytest.raises(CheckpointError, match=f"'{escaping}' resolves to .*, outside the checkpoint folder"):
        load_checkpoint(bad)


def test_project_checkpoint_ignores_a_config_json_beside_it(tiny_model, hf_folder, tmp_path):
    from andrea_export.model.checkpoint import save_checkpoint

    path = save_checkpoint(tiny_model, tmp_path / "ours.safetensors")
    before = checkpoint_sha256(path)
    shutil.copy(hf_folder / "config.json", tmp_path / "config.json")  # another model's config, 1000-token vocab
    assert load_checkpoint(path).cfg == tiny_model.cfg and checkpoint_sha256(path) == before


def test_layer_norm_epsilon_is_read_and_used(tmp_path):
    """A GPT-2 with layer_norm_epsilon 1e-3 (every other test uses 1e-5): our model's logits are transformers'.
    A LayerNorm that ignored cfg.layer_norm_eps (a planted bug no test caught) differs by far more."""
    import dataclasses

    from andrea_export.model.andrea import Andrea

    hf = _gpt2(layer_norm_epsilon=1e-3)
    hf.save_pretrained(tmp_path / "eps")
    ours = load_checkpoint(tmp_path / "eps")
    assert ours.cfg.layer_norm_eps == 1e-3
    ids = torch.tensor(IDS)
    with torch.no_grad():
        got = ours(ids).numpy()
        wrong = Andrea(dataclasses.replace(ours.cfg, layer_norm_eps=1e-5))
        wrong.load_state_dict(ours.state_dict())
        bad = wrong.eval()(ids).numpy()
    np.testing.assert_allclose(got, _hf_logits(hf, IDS), atol=1e-4, rtol=1e-4)
    assert np.abs(bad - got).max() > 1e-2  # the check above can fail: the epsilon matters at this size

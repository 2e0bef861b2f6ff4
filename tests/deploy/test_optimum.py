"""`export --hf-folder`: a folder Hugging Face Optimum's ORTModelForCausalLM loads and generates from."""

import pytest
import torch


def test_optimum_generate_equals_our_greedy(lively_model, lively_decoder, lively_prompt, tmp_path):
    """`export --hf-folder`: Optimum's ORTModelForCausalLM loads it; its greedy generate() equals ours."""
    pytest.importorskip("optimum.onnxruntime", reason="optimum-onnx (the 'hf' extra)")
    from click.testing import CliRunner
    from optimum.onnxruntime import ORTModelForCausalLM

    from andrea_export import runtime
    from andrea_export.cli import main
    from andrea_export.model.checkpoint import save_checkpoint

    ckpt = save_checkpoint(lively_model, tmp_path / "lively.safetensors")
    folder = tmp_path / "hf"
    result = CliRunner().invoke(main, ["export", "--checkpoint", str(ckpt), "--hf-folder", str(folder)])
    assert result.exit_code == 0, result.output
    assert {p.name for p in folder.iterdir()} == {"model.onnx", "config.json", "generation_config.json"}
    prompt = lively_prompt
    with runtime.load(lively_decoder, "onnxruntime") as sess:
        ours = sess.generate(prompt, 64)
    assert len(set(ours)) > 10
    model = ORTModelForCausalLM.from_pretrained(folder)
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, min_new_tokens=64,
                         do_sample=False)
    assert out[0, len(prompt):].tolist() == ours


def test_hf_folder_refuses_an_occupied_folder(tiny_model, tmp_path):
    from andrea_export.deploy.optimum import write_hf_folder
    from andrea_export.errors import ExportError

    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="not an empty folder"):
        write_hf_folder(tiny_model, tmp_path, quiet=True)
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_an_hf_folder_with_its_tokenizer_generates_text(lively_model, demo_dir, tmp_path):
    """`export --hf-folder DIR --tokenizer T`: Optimum's model and transformers' tokenizer from one folder."""
    pytest.importorskip("optimum.onnxruntime", reason="optimum-onnx (the 'hf' extra)")
    from click.testing import CliRunner
    from optimum.onnxruntime import ORTModelForCausalLM
    from transformers import AutoTokenizer

    from andrea_export.cli import main
    from andrea_export.model.checkpoint import save_checkpoint
    from andrea_export.model.text import encode, load_tokenizer

    ckpt = save_checkpoint(lively_model, tmp_path / "lively.safetensors")
    folder = tmp_path / "hf"
    result = CliRunner().invoke(main, ["export", "--checkpoint", str(ckpt), "--hf-folder", str(folder),
                                       "--tokenizer", str(demo_dir / "tokenizer.json")])
    assert result.exit_code == 0, result.output
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in folder.iterdir()}
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok("Return a new", return_tensors="pt")
    assert ids["input_ids"][0].tolist() == encode(load_tokenizer(demo_dir / "tokenizer.json"), "Return a new")
    out = ORTModelForCausalLM.from_pretrained(folder).generate(**ids, max_new_tokens=8, do_sample=False)
    assert tok.decode(out[0]).startswith("Return a new") and len(out[0]) == ids["input_ids"].shape[1] + 8
    refused = CliRunner().invoke(main, ["export", "--tokenizer", str(demo_dir / "tokenizer.json")])
    assert refused.exit_code == 2 and "--tokenizer goes with --hf-folder" in refused.output

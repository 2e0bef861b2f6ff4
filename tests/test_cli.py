import json

import pytest
from click.testing import CliRunner

from andrea_export.cli import main


def test_help_teaches():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    for command in ("export", "verify"):
        assert command in result.output


def test_serve_help_curls_the_endpoints_a_default_serve_opens():
    """The examples a user pastes reach a default serve: the front's port and /health (Triton's HTTP port opens
    only with --port)."""
    from andrea_export.cli import serve

    result = CliRunner().invoke(main, ["serve", "--help"])
    assert result.exit_code == 0
    curls = [line.split()[2] for line in result.output.splitlines() if line.strip().startswith("curl ")]
    port = next(p.default for p in serve.params if p.name == "openai_port")
    assert curls == [f"localhost:{port}/v1/completions", f"localhost:{port}/health"], curls


def test_export_then_verify(tmp_path):
    runner = CliRunner()
    out = tmp_path / "m.onnx"
    result = runner.invoke(main, ["export", "--config", "andrea-tiny", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "2 tanh-GELU, 649,024 parameters" in result.output
    result = runner.invoke(main, ["verify", str(out), "--shapes", "1x2,2x16", "--greedy-steps", "4"])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "m.onnx.verify.json").read_text())
    assert report["passed"] and report["shapes"] == [[1, 2], [2, 16]]


def test_bad_input_is_one_line_and_exit_1(tmp_path):
    result = CliRunner().invoke(main, ["export", "--config", "nope", "--out", str(tmp_path / "m.onnx")])
    assert result.exit_code == 1
    assert "error: no model config 'nope'" in result.output
    assert "Traceback" not in result.output
    result = CliRunner().invoke(main, ["verify", str(tmp_path / "absent.onnx")])
    assert result.exit_code == 1 and "no such ONNX file" in result.output


def test_bad_shapes_option(tmp_path):
    result = CliRunner().invoke(main, ["verify", "x.onnx", "--shapes", "1by2"])
    assert result.exit_code == 2 and "expected BATCHxSEQ" in result.output


def test_generate_several_prompts(lively_decoder):
    from andrea_export import runtime

    folder, prompts = lively_decoder.parent, ["5,6,7,8,9", "300", "1 2 3"]
    args = ["generate", str(folder), "-n", "6", "--strategy", "top-k", "--seed", "4"]
    result = CliRunner().invoke(main, args + [a for p in prompts for a in ("--prompt-ids", p)])
    assert result.exit_code == 0, result.output
    sess = runtime.load(folder)
    alone = [sess.generate([int(x) for x in p.replace(",", " ").split()], 6, strategy="top-k", seed=4) for p in prompts]
    assert result.stdout.splitlines() == [" ".join(map(str, a)) for a in alone]
    result = CliRunner().invoke(main, ["generate", str(folder), "--prompt-ids", "1", "--prompt-ids", "2,x"])
    assert result.exit_code == 2 and "not a list of integers: '2,x'" in result.output
    result = CliRunner().invoke(main, ["generate", str(folder), "--prompt-ids", "1", "--prompt-ids", "8449"])
    assert result.exit_code == 1
    assert "error: request 1: prompt token id 8449 at position 0 is outside the vocabulary [0, 8449)" in result.output


def test_generate_on_openvino_in_f32_gives_onnx_runtimes_tokens(lively_decoder):
    pytest.importorskip("openvino", reason="OpenVINO (the 'openvino' extra) is not installed")
    folder = str(lively_decoder.parent)
    args = ["generate", folder, "-n", "12", "--prompt-ids", "5,6,7,8,9"]
    ort = CliRunner().invoke(main, args)
    ov = CliRunner().invoke(main, args + ["--backend", "openvino", "--inference-precision", "f32"])
    assert ort.exit_code == ov.exit_code == 0, ov.output
    assert ov.stdout == ort.stdout and len(ov.stdout.split()) == 12
    bad = CliRunner().invoke(main, args + ["--inference-precision", "f32"])
    assert bad.exit_code == 1 and "inference_precision is an OpenVINO setting" in bad.output
    bad = CliRunner().invoke(main, args + ["--kv-cache-precision", "u8"])
    assert bad.exit_code == 1 and "kv_cache_precision is an OpenVINO setting" in bad.output
    f32_cache = CliRunner().invoke(main, args + ["--backend", "openvino", "--inference-precision", "f32",
                                                 "--kv-cache-precision", "f32"])  # fmt: skip
    assert f32_cache.exit_code == 0 and f32_cache.stdout == ort.stdout


_NOISY = r"""
import logging, sys
from andrea_export.cli import main

@main.command("noisy")
def noisy():
    logging.basicConfig(level=logging.INFO)  # what ONNX Runtime's quantizer does when it is imported
    logging.getLogger("onnx_ir.passes.common.unused_removal").info("Removed 55 unused nodes")
    print("ours")

main(sys.argv[1:])
"""


@pytest.mark.parametrize("verbose", [False, True])
def test_library_log_lines_reach_the_terminal_only_with_verbose(verbose):
    """An int4 build printed about 90 '[INFO]' lines of onnxscript and onnx_ir through the progress display."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _NOISY, *(["-v"] if verbose else []), "noisy"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and run.stdout == "ours\n", run.stderr
    assert ("Removed 55 unused nodes" in run.stderr) == verbose, run.stderr


def test_inspect_reads_as_text_with_both_engines_profiles(lively_build):
    result = CliRunner().invoke(main, ["inspect", str(lively_build)])
    assert result.exit_code == 0, result.output
    assert "{'" not in result.output and "['" not in result.output  # no Python reprs
    for line in ("decoder_profiles:", "prefill:", "decode:", "input_ids: min [1, 1]", "compute_capabilities: 8.0, 8.6"):
        assert line in result.output, result.output

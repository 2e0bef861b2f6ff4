"""runtime.load(...) on ONNX Runtime: forward, generate with the KV cache kept between steps, greedy
agreement with PyTorch (full recompute, no cache), and every bad input refused with its message before
anything runs."""

from __future__ import annotations

import contextlib
import shutil

import numpy as np
import onnxruntime as ort
import pytest
import torch

from andrea_export import runtime
from andrea_export.errors import ExportError
from andrea_export.runtime import InputError
from andrea_export.runtime.ort import OrtSession
from andrea_export.verify.agreement import greedy_agreement


@pytest.fixture(scope="module")
def prompt(lively_prompt):
    return lively_prompt


def test_load_folder_or_file_auto_is_onnxruntime(build_dir):
    for path in (build_dir, build_dir / "decoder.onnx", str(build_dir)):
        sess = runtime.load(path)
        assert isinstance(sess, OrtSession) and sess.backend == "onnxruntime"
        assert sess.cfg.name == "andrea-tiny" and sess.layout.n_layer == 2


def test_forward_matches_pytorch(session, lively_model):
    ids = [7, 70, 700, 7000, 3, 33, 333]
    logits = session.forward(ids)
    with torch.inference_mode():
        want = lively_model(torch.tensor([ids]))[0].numpy()
    assert logits.shape == (7, 8449) and logits.dtype == np.float32
    np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-4)


def test_greedy_64_tokens_agree_with_full_recompute(session, lively_model, prompt):
    report = greedy_agreement(lively_model, session, prompt, n_tokens=64)
    assert report["agree"], {k: v for k, v in report.items() if "tokens" not in k}
    assert report["matched"] == 64 and report["first_divergence"] is None and report["at_divergence"] is None
    assert report["candidate_tokens"] == report["reference_tokens"]
    assert len(set(report["reference_tokens"])) > 10  # the decode really varies
    assert report["max_abs_logit_diff"] < 1e-4
    assert report["min_reference_margin"] > 0
    assert session.generate(prompt, 64) == report["reference_tokens"]


def test_greedy_agreement_reports_the_first_divergence(lively_model, session, prompt):
    class Nudged(runtime.Session):  # the ORT session, with one token's logit raised at step 3
        backend = "nudged"

        def __init__(self):
            super().__init__(session.cfg, session.layout, "nudged")

        @contextlib.contextmanager
        def _steps(self, capacity=None):
            with session._steps(capacity) as steps:
                yield NudgedSteps(steps)

    class NudgedSteps(runtime.Steps):
        def __init__(self, steps):
            self.steps, self.step = steps, 0

        def prefill(self, ids, mask):
            return self.steps.prefill(ids, mask)

        def decode(self, tokens, mask):
            self.step += 1
            logits = self.steps.decode(tokens, mask).copy()
            if self.step == 3:
                logits[:, 42] = logits.max() + 0.5
            return logits

    report = greedy_agreement(lively_model, Nudged(), prompt, n_tokens=8)
    assert not report["agree"]
    assert report["first_divergence"] == report["matched"] == 3
    at = report["at_divergence"]
    assert at["candidate_token"] == 42 and at["reference_token"] == report["reference_tokens"][3]
    assert at["candidate_margin"] == pytest.approx(0.5, abs=1e-3)
    assert at["reference_margin"] >= 0
    # with a precision's tolerances: a divergence passes only where every logit up to it is within them
    assert "passed" not in report
    assert not greedy_agreement(lively_model, Nudged(), prompt, n_tokens=8, rtol=1e-2, atol=1e-2)["passed"]
    assert greedy_agreement(lively_model, Nudged(), prompt, n_tokens=8, rtol=0, atol=100.0)["passed"]
    assert greedy_agreement(lively_model, session, prompt, n_tokens=8, rtol=1e-4, atol=1e-4)["passed"]


def test_an_existing_inference_session_is_used_as_it_is(build_dir, monkeypatch):
    """`OrtSession(..., session=s)` steps over `s` (made with the caller's options: the benchmark's threads
    and spin-waiting) instead of loading the graph a second time, and still gives the same tokens."""
    from andrea_export.graphs.layout import read_decoder

    path = build_dir / "decoder.onnx"
    cfg, layout = read_decoder(path)
    own = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    loads = []
    monkeypatch.setattr(ort, "InferenceSession", lambda *a, **k: loads.append(a))
    wrapped = OrtSession(path, cfg, layout, session=own)
    assert wrapped.session is own and loads == []
    monkeypatch.undo()
    assert wrapped.generate([1, 2, 3], 5) == runtime.load(path).generate([1, 2, 3], 5)


def test_cache_stays_on_the_device_between_steps(session):
    with session._steps() as steps:  # one call's own cache
        steps.prefill(np.array([[0, 1, 2, 3]]), np.array([[0, 1, 1, 1]]))  # one padded slot
        first = steps.past
        assert all(isinstance(v, ort.OrtValue) and v.device_name() == "cpu" for v in first)
        assert first[0].shape() == [1, 4, 4, 16]
        steps.decode(np.array([4]), np.array([[0, 1, 1, 1, 1]]))
        assert steps.past[0].shape() == [1, 4, 5, 16]


def test_sampling_is_seeded_and_stops(session, prompt):
    a = session.generate(prompt, 20, strategy="top-p", top_p=0.9, temperature=0.8, seed=3)
    assert a == session.generate(prompt, 20, strategy="top-p", top_p=0.9, temperature=0.8, seed=3)
    b = session.generate(prompt, 20, strategy="top-k", top_k=50, temperature=1.5, seed=3)
    assert len(a) == len(b) == 20 and all(0 <= t < 8449 for t in a + b)
    greedy = session.generate(prompt, 20)
    assert session.generate(prompt, 20, strategy="top-k", top_k=1, seed=9) == greedy
    stop = greedy[5]
    first = greedy.index(stop)
    assert session.generate(prompt, 20, stop_ids=[stop]) == greedy[: first + 1]


@pytest.fixture(scope="module")
def talking_folder(build_dir, demo_dir, tmp_path_factory):
    """The lively decoder with the demo's tokenizer beside it: a folder whose tokenizer names its end of text."""
    folder = tmp_path_factory.mktemp("talking") / "decoder"
    shutil.copytree(build_dir, folder)
    shutil.copy(demo_dir / "tokenizer.json", folder / "tokenizer.json")
    return folder


def test_generation_stops_at_the_tokenizers_end_of_text(talking_folder, prompt):
    """A folder whose tokenizer names an end-of-text token stops there by default (the token is the last one
    returned), in one call, a batch and a stream, and the batcher admits it as a stop; ignore_eos runs on; a folder without a tokenizer
    has no end. The end is taken from tokenizer_config.json's eos_token when there is one (else <|endoftext|>,
    id 0 in ours): naming one of the tokens the model does generate shows the stop."""
    import json

    from andrea_export.model.text import load_tokenizer

    with runtime.load(talking_folder, backend="onnxruntime") as sess:
        assert sess.eos_id == 0
        full = sess.generate(prompt, 24, ignore_eos=True)
    end = full[6]
    (talking_folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": load_tokenizer(talking_folder / "tokenizer.json").id_to_token(end)}))
    cut = full[: full.index(end) + 1]
    with runtime.load(talking_folder, backend="onnxruntime") as sess:
        assert sess.eos_id == end
        assert sess.generate(prompt, 24) == cut
        assert sess.generate([prompt, prompt], 24) == [cut, cut]
        assert sess.generate_batch([runtime.Request(prompt, 24), runtime.Request(prompt, 24, ignore_eos=True)]) == [cut, full]
        assert [t for t, _ in sess.stream(prompt, 24)] == cut
        assert sess.check(runtime.Request(prompt, 24)).stops == {end}  # what the batcher admits (test_serve)
        with pytest.raises(InputError, match="ignore_eos must be true or false, got 'no'"):
            sess.generate(prompt, 4, ignore_eos="no")
    (talking_folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "no such token"}))
    with runtime.load(talking_folder, backend="onnxruntime") as sess:
        assert sess.eos_id is None and sess.generate(prompt, 24) == full


def test_a_folder_without_a_tokenizer_has_no_end(session):
    assert session.eos_id is None



@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ([], {}, "prompt is empty: give at least one token id"),
        ([1, 8449], {}, "prompt token id 8449 at position 1 is outside the vocabulary [0, 8449)"),
        ([-1, 5, 9000], {}, "prompt token id -1 at position 0 is outside the vocabulary [0, 8449) (2 such ids)"),
        ([1.5], {}, "prompt must hold integer token ids, got float64"),
        ([[[1, 2]]], {}, "prompt must be a flat sequence of token ids, got an array of shape [1, 2]"),
        ([[1, 2], []], {}, "request 1: prompt is empty: give at least one token id"),
        ([1, [2, 3]], {}, "prompt must be a flat sequence of token ids"),
        ([[1], [2]], {"seed": [1, 2, 3]}, "seed: 3 values for 2 prompts (give one, or one per prompt)"),
        ([[1], list(range(100))], {"max_new_tokens": [4, 29]},
         "request 1: prompt (100 tokens) + max_new_tokens (29) = 129 exceeds the model's context of 128 tokens"),
        (list(range(100)), {"max_new_tokens": 29},
         "prompt (100 tokens) + max_new_tokens (29) = 129 exceeds the model's context of 128 tokens"),
        ([1], {"max_new_tokens": 0}, "max_new_tokens must be a positive integer, got 0"),
        ([1], {"strategy": "beam"}, "unknown sampling strategy 'beam'; choose one of greedy, top-k, top-p"),
        ([1], {"strategy": "top-p", "temperature": 0},
         "temperature must be a number > 0, got 0 (for deterministic decoding use strategy 'greedy')"),
        ([1], {"strategy": "top-k", "top_k": 0}, "top_k must be an integer in 1..8449 (the vocabulary size), got 0"),
        ([1], {"strategy": "top-p", "top_p": 1.5}, "top_p must be a number in (0, 1], got 1.5"),
        ([1], {"stop_ids": [9999]}, "stop_ids token id 9999 at position 0 is outside the vocabulary [0, 8449)"),
        ([1], {"strategy": "top-k", "seed": -1}, "seed must be an integer in 0..2**63-1 (or none), got -1"),
        ([1], {"strategy": "top-k", "seed": 2**63}, f"seed must be an integer in 0..2**63-1 (or none), got {2**63}"),
        ([1], {"seed": 1.5}, "seed must be an integer in 0..2**63-1 (or none), got 1.5"),
        ([1], {"seed": True}, "seed must be an integer in 0..2**63-1 (or none), got True"),
    ],
)
def test_generate_refuses_bad_input(session, args, kwargs, message):
    kwargs = dict(kwargs)
    kwargs.setdefault("max_new_tokens", 4)
    with pytest.raises(InputError) as e:
        session.generate(args, **kwargs)
    assert str(e.value) == message


def test_forward_refuses_bad_input(session):
    with pytest.raises(InputError) as e:
        session.forward(list(range(129)))
    assert str(e.value) == "input (129 tokens) exceeds the model's context of 128 tokens"
    with pytest.raises(InputError) as e:
        session.forward([])
    assert str(e.value) == "input is empty: give at least one token id"


def test_load_refuses(build_dir, tiny_onnx, tmp_path):
    with pytest.raises(InputError) as e:
        runtime.load(tmp_path / "nowhere")
    assert str(e.value) == f"no such build folder or ONNX file: {tmp_path / 'nowhere'}"

    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError) as e:
        runtime.load(tmp_path / "empty")
    assert str(e.value) == f"{tmp_path / 'empty'}: no KV-cache decoder graph in this folder (expected decoder.onnx or a manifest.json)"

    with pytest.raises(InputError) as e:
        runtime.load(build_dir, backend="tvm")
    assert str(e.value) == "unknown backend 'tvm'; choose one of auto, onnxruntime, tensorrt, openvino"

    with pytest.raises(InputError) as e:
        runtime.load(build_dir, backend="tensorrt")
    assert str(e.value) == (
        f"{build_dir}: backend 'tensorrt' needs a decoder engine (decoder.plan); "
        "this has only the ONNX graph (build one with `andrea-export build`)"
    )

    with pytest.raises(ExportError) as e:  # the standard graph (no cache) is not something generate can use
        runtime.load(tiny_onnx)
    assert str(e.value).startswith(f"{tiny_onnx}: has no 'andrea.kv_layout' metadata: not a KV-cache decoder graph")

    lonely = tmp_path / "lonely"
    lonely.mkdir()
    shutil.copy(build_dir / "decoder.onnx", lonely / "other.onnx")
    (lonely / "decoder.plan").write_bytes(b"x")
    (lonely / "decoder.onnx").unlink(missing_ok=True)
    with pytest.raises(InputError) as e:
        runtime.load(lonely / "decoder.plan")
    assert str(e.value) == f"{lonely / 'decoder.plan'}: a TensorRT engine needs its decoder.onnx beside it (for the model config and cache layout)"


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_verify_decoder_in_half_precision(lively_model, build_dir, tmp_path, precision):
    """The build's step-by-step decoder check on an fp16 / bf16 graph. ONNX Runtime's CPU provider has no
    bf16 kernels: a bf16 graph runs as its emulate_in_fp32 twin (every op rounded to bf16)."""
    from andrea_export.graphs.precision import convert_precision
    from andrea_export.verify.agreement import verify_decoder
    from andrea_export.verify.thresholds import TOLERANCES

    graph = convert_precision(build_dir / "decoder.onnx", tmp_path / f"decoder.{precision}.onnx", precision)
    report = verify_decoder(lively_model, graph, [[5, 6, 7, 8, 9], [300, 200]], steps=4, **TOLERANCES[precision])
    assert report["passed"], report
    assert all(s["max_abs_logits"] > 0 for s in report["per_step"])  # really computed in the lower precision


def test_a_closed_session_refuses_calls_and_lets_go_of_onnx_runtime(build_dir):
    import gc
    import weakref

    sess = runtime.load(build_dir, "onnxruntime")
    assert sess.generate([1, 2, 3], 2)
    held = weakref.ref(sess.session)
    stream = sess.stream([1, 2, 3], 4)  # a call in flight keeps its session until it ends
    first = next(stream)
    sess.close()
    assert len([first, *stream]) == 4
    gc.collect()
    assert held() is None, "the closed session still holds ONNX Runtime's"
    for call in (lambda: sess.generate([1, 2], 1), lambda: sess.forward([1, 2]), lambda: next(sess.stream([1], 1))):
        with pytest.raises(runtime.InputError, match="this session is closed"):
            call()


def test_forward_stepwise_reaches_the_last_slot_and_equals_forward(session):
    """forward_stepwise: a prefill of n - 2 then decode steps at past n - 2 and n - 1 (which generate never
    feeds), equal to one prefill of the n tokens; a prompt_len outside 1..len(ids) is refused."""
    from andrea_export.errors import InputError

    n = session.cfg.n_positions
    ids = np.random.default_rng(3).integers(0, session.cfg.vocab_size, n).tolist()
    stepped, whole = session.forward_stepwise(ids, n - 2), session.forward(ids)
    assert stepped.shape == whole.shape == (n, session.cfg.vocab_size)
    np.testing.assert_allclose(stepped, whole, rtol=1e-4, atol=1e-4)
    with pytest.raises(InputError, match="prompt_len must be 1..128"):
        session.forward_stepwise(ids, 0)
    with pytest.raises(InputError, match="exceeds the model's context"):
        session.forward_stepwise(ids + [1], n - 2)

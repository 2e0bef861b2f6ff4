"""Real text: the corpus split, the 8449-token tokenizer (deterministic, lossless on held-out text),
perplexity arithmetic, and the trained demo model (tests/conftest.py trains it once and caches it)."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from andrea_export.config import ANDREA_TINY
from andrea_export.errors import ConfigError
from andrea_export.model import demo, text

pytest.importorskip("tokenizers", reason="the 'text' extra (Hugging Face tokenizers) trains the tokenizer")


@pytest.fixture(scope="module")
def split():
    return text.corpus()


@pytest.fixture(scope="module")
def tokenizer(demo_dir):
    return text.load_tokenizer(demo_dir / "tokenizer.json")


def test_corpus_split_is_disjoint_and_recorded(split):
    train, held = split
    assert len(held) >= 20 and sum(map(len, held)) > 30_000
    assert not set(held) & set(train)
    info = text.corpus_info(train, held)
    assert info["heldout_chars"] == len(text.join(held)) and info["python"].count(".") == 2
    assert len(info["train_sha256"]) == 64 and info["train_sha256"] != info["heldout_sha256"]


def test_tokenizer_has_8449_tokens_and_two_trainings_give_the_same_bytes(split, demo_dir):
    first = text.train_tokenizer(split[0]).to_str()
    second = text.train_tokenizer(split[0]).to_str()
    assert first == second
    assert (demo_dir / "tokenizer.json").read_text() == first  # the demo's tokenizer is this one
    vocab = json.loads(first)["model"]["vocab"]
    assert len(vocab) == 8449 == text.VOCAB_SIZE == ANDREA_TINY.vocab_size
    assert vocab[text.EOT] == 0 and sorted(vocab.values()) == list(range(8449))


def test_round_trip_on_held_out_text(tokenizer, split):
    held = text.join(split[1])
    ids = text.encode(tokenizer, held)
    assert max(ids) < 8449 and len(ids) < len(held) / 3  # BPE merges: well under one token per 3 chars
    assert tokenizer.decode(ids, skip_special_tokens=False) == held
    for doc in split[1]:
        assert tokenizer.decode(text.encode(tokenizer, doc)) == doc


def test_a_tokenizer_too_small_for_its_corpus_is_refused():
    with pytest.raises(ConfigError, match="not 8449"):
        text.train_tokenizer(["a few words, a few words"])


def test_load_tokenizer_refuses_other_files(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"not": "a tokenizer"}')
    with pytest.raises(ConfigError, match="not a readable tokenizer.json"):
        text.load_tokenizer(bad)


def test_perplexity_is_exp_of_the_mean_cross_entropy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 9, 50)).astype(np.float32)
    ids = rng.integers(0, 50, size=(3, 9))
    want = torch.nn.functional.cross_entropy(torch.from_numpy(logits[:, :-1]).reshape(-1, 50).double(),
                                             torch.from_numpy(ids[:, 1:]).reshape(-1))
    got = text.perplexity(lambda x: logits[: len(x)] if len(x) == 3 else None, ids, batch=3)
    assert got == pytest.approx(math.exp(want.item()), rel=1e-12)
    assert text.perplexity(lambda x: np.zeros((*x.shape, 50)), ids) == pytest.approx(50)  # uniform: the vocab


def test_unigram_perplexity_of_a_known_distribution():
    train = [0] * 6 + [1] * 2  # add-one smoothing over 4 tokens: p = 7/12, 3/12, 1/12, 1/12
    eval_ids = np.array([[3, 0, 1]])
    assert text.unigram_perplexity(train, eval_ids, vocab_size=4) == pytest.approx(math.sqrt(12 / 7 * 12 / 3))


def test_windows_drop_the_tail_and_refuse_too_short_a_text():
    assert text.windows(list(range(10)), 4).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ConfigError, match="fewer than one window"):
        text.windows([1, 2], 4)


def test_trained_model_beats_the_unigram_perplexity(demo_dir, demo_log):
    ppl, unigram = demo_log["heldout_perplexity"], demo_log["unigram_perplexity"]
    assert ppl < unigram / 2, (ppl, unigram)
    assert demo_log["initial_heldout_perplexity"] > 8000  # untrained: about uniform over 8449
    assert demo_log["corpus"]["python"] and demo_log["tokenizer"]["vocab_size"] == 8449
    assert len(demo_log["loss"]) == demo_log["recipe"]["steps"]
    assert np.mean(demo_log["loss"][-20:]) < np.mean(demo_log["loss"][:20]) - 2
    assert (demo_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the perplexity is the checkpoint's: recomputed from the saved weights, to the last bit
    from andrea_export.model.checkpoint import load_checkpoint

    tok = text.load_tokenizer(demo_dir / "tokenizer.json")
    wins = text.windows(text.encode(tok, (demo_dir / "heldout.txt").read_text()), ANDREA_TINY.n_positions)
    with demo._deterministic(1):
        assert demo.model_perplexity(load_checkpoint(demo_dir / "model.safetensors"), wins) == ppl


def test_training_is_bit_identical_from_the_same_seed():
    """Two short trainings with the same seed give the same losses and weights, bit for bit; another
    seed does not."""
    gen = torch.Generator().manual_seed(0)
    stream = torch.randint(0, 8449, (5000,), generator=gen)
    wins = stream[:2 * 128].numpy().reshape(2, 128)
    recipe = dataclasses.replace(demo.Recipe(), steps=3, batch=2, eval_every=3)

    def run(r):
        model, losses, curve = demo.train_model(stream, wins, r)
        return torch.cat([p.flatten() for p in model.state_dict().values()]), losses, curve

    (w1, l1, c1), (w2, l2, c2) = run(recipe), run(recipe)
    assert torch.equal(w1, w2) and l1 == l2 and c1 == c2
    w3, l3, _ = run(dataclasses.replace(recipe, seed=1))
    assert not torch.equal(w1, w3) and l1 != l3


def test_cache_key_follows_the_recipe():
    assert demo.cache_key() == demo.cache_key(demo.Recipe())
    assert demo.cache_key(dataclasses.replace(demo.Recipe(), seed=1)) != demo.cache_key()


def test_reflow_joins_wrapped_prose_and_keeps_code():
    assert text.reflow("A paragraph\nwrapped at\nseventy columns.") == "A paragraph wrapped at seventy columns."
    assert text.reflow("   indented\n   prose") == "   indented prose"
    assert text.reflow("* a list item\n  that hangs") == "* a list item that hangs"
    for kept in ("def f(x):\n    return x", "Title\n*****", ">>> 1 + 1\n2", "one line"):
        assert text.reflow(kept) == kept

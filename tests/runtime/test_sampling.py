"""Next-token choice: greedy, top-k and top-p keep exactly the tokens they should, and are seeded."""

import numpy as np
import pytest

from andrea_export.runtime import InputError, Sampling, next_token


def _support(logits, sampling, draws=400):
    rng = np.random.default_rng(0)
    return {next_token(logits, sampling, rng) for _ in range(draws)}


LOGITS = np.log(np.array([0.05, 0.5, 0.15, 0.3], dtype=np.float32))  # ranks: 1, 3, 2, 0


def test_greedy_takes_the_first_maximum():
    assert next_token(np.array([0.0, 2.0, 2.0, 1.0]), Sampling("greedy"), np.random.default_rng(0)) == 1


def test_top_k_keeps_the_k_most_likely():
    assert _support(LOGITS, Sampling("top-k", top_k=2)) == {1, 3}
    assert _support(LOGITS, Sampling("top-k", top_k=1)) == {1}
    assert _support(LOGITS, Sampling("top-k", top_k=4)) == {0, 1, 2, 3}


def test_top_p_keeps_the_nucleus():
    assert _support(LOGITS, Sampling("top-p", top_p=0.75)) == {1, 3}  # 0.5 + 0.3 reaches 0.75
    assert _support(LOGITS, Sampling("top-p", top_p=0.4)) == {1}
    assert _support(LOGITS, Sampling("top-p", top_p=1.0)) == {0, 1, 2, 3}


def test_temperature_sharpens():
    hot = [next_token(LOGITS, Sampling("top-k", top_k=4, temperature=0.05), np.random.default_rng(s)) for s in range(50)]
    assert set(hot) == {1}


def test_seeded_draws_repeat():
    s = Sampling("top-p", top_p=0.95)
    a = [next_token(LOGITS, s, rng) for rng in [np.random.default_rng(7)] for _ in range(30)]
    b = [next_token(LOGITS, s, rng) for rng in [np.random.default_rng(7)] for _ in range(30)]
    assert a == b


def test_bool_is_not_a_number():
    with pytest.raises(InputError) as e:
        Sampling("top-k", top_k=True).check(10)
    assert str(e.value) == "top_k must be an integer in 1..10 (the vocabulary size), got True"


@pytest.mark.parametrize("strategy", ["top-k", "top-p"])
@pytest.mark.parametrize("temperature", [1e-310, 5e-324, 1e-300])
def test_a_tiny_temperature_is_greedy_not_nan(strategy, temperature):
    """Logits divided by a subnormal temperature overflow to inf; inf - inf is NaN, which numpy's draw refuses.
    The limit of sampling as the temperature goes to 0 is greedy, so that is what a tiny one must give."""
    logits = np.random.default_rng(3).standard_normal(500).astype(np.float32) * 30
    s = Sampling(strategy, temperature=temperature, top_k=50, top_p=0.9).check(500)
    assert {next_token(logits, s, np.random.default_rng(i)) for i in range(20)} == {int(np.argmax(logits))}


def test_a_tiny_temperature_keeps_ties_among_the_maxima():
    logits = np.array([1.0, 3.0, 3.0, -2.0], dtype=np.float32)
    s = Sampling("top-k", temperature=1e-310, top_k=4).check(4)
    assert {next_token(logits, s, np.random.default_rng(i)) for i in range(200)} == {1, 2}

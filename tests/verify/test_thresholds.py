"""verify/thresholds.py's bounds, every one pinned both ways.

Through the real verdict (compare.verify on stand-in models with synthetic numpy logits; its lm_metrics, lm_passed
and lm_thresholds; its perplexity check): an error just inside a bound passes and one just beyond it fails. And
against the measurements thresholds.py's comments give: each bound keeps the margin claimed there over the error
the precision really makes (tightening it fails right graphs) and stays short of the error of the defect it must
catch (loosening it lets that defect through). A changed bound breaks a test here that says which of the two it
broke; the measured figures are written once below, each from thresholds.py's comments. No model, no export.
"""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
import torch

from andrea_export.names import PRECISIONS
from andrea_export.verify import thresholds
from andrea_export.verify.compare import TorchRunner, lm_passed, verify
from andrea_export.verify.thresholds import MAX_KL, MAX_PPL_REL, MIN_TOP1, MIN_TOP5, TOLERANCES, TOP1_TIE, TOP5_TIE

# ---- What thresholds.py's comments measured (the worst figure of the graphs verify judges; see there) ----
LARGEST_LOGIT = 16.3  # the trained andrea-tiny's max |logit|
WHOLE_UNIT = 1.0  # "a wrong kernel moves logits by whole units" (TOP1_TIE's comment)
# max |logit error|: fp32 ONNX Runtime CPU; fp16 / bf16 emulate_in_fp32 (pessimistic; fp16 ONNX Runtime 9.4e-3);
# int8 MatMulNBits on the Intel-trained demo (andrea-tiny: 0.190); int4 the engines' Q/DQ, scale searched
# (MatMulNBits 1.67 / 1.76)
MAX_ERR = {"fp32": 9.5e-6, "fp16": 1.9e-2, "bf16": 1.7e-1, "int8": 0.338, "int4": 2.42}
# "atol needed" at TOLERANCES' rtol (fp32 trained ids; fp16 / bf16 the earlier training, emulated: this one needed
# 8.6e-3 / 1.2e-1); int8 / int4 give max |err| only, which bounds it
ATOL_NEEDED = {"fp32": 3.7e-6, "fp16": 1.3e-2, "bf16": 1.6e-1, "int8": MAX_ERR["int8"], "int4": MAX_ERR["int4"]}
BF16_ATOL_NEEDED = 1.2e-1  # this training's bf16 (the error of an fp16 graph that computes in bf16)
INT4_MAX_ERR = 1.67  # andrea-tiny's MatMulNBits int4 (the error of an int8 graph that quantized to 4 bits)
# The margin of atol over ATOL_NEEDED that holds. thresholds.py: fp32 "far above the CPU's 1e-5 on purpose" (GPU
# engines reorder reductions); fp16 / bf16 ">= 2.5x over the worst measurement of either training", which fp16
# misses against the earlier training's 1.3e-2 (2.3x; 3.5x over this one's 8.6e-3); int8 / int4 "about 3x the
# worst measurement": 3.2x / 3.0x over andrea-tiny's 0.190 / 1.67, but 1.8x / 2.1x over the worst in the
# Q/DQ table (0.338 / 2.42)
ATOL_MARGIN = {"fp32": 10, "fp16": 2.3, "bf16": 2.5, "int8": 1.7, "int4": 2.0}
FP32_BAR = 1e-4  # the foundation issue's bar for fp32: about 1e-4 relative on the logits

# Share of positions whose top-1 flips: fp32 none; fp16 emulated on the random 120M (99.6 %; ONNX Runtime 100 %);
# bf16 on the random 120M (96.3 %); int8 in blocks of 64 (96.5 %; 96.9 % now)
TOP1_MISSES = {"fp32": 0.0, "fp16": 0.004, "bf16": 0.037, "int8": 0.035}
FP16_TOP1_MISSES_TRAINED = 0.002  # fp16 emulated, trained (99.8 %): what an fp32 graph computing in fp16 flips
BF16_TOP1_MISSES_TEXT = 0.021  # bf16 on held-out text (97.9 %): the fewest bf16 flips measured
BF16_FLIPPED_MARGINS = (0.0028, 0.0058, 0.0086)  # the reference's margins where bf16 on Intel AMX flipped top-1
BF16_AMX_LOGIT_ERR = 0.05  # the low end of that machine's bf16 logit error (0.05-0.15)
INT4_TOP5 = 0.844  # int4's worst top-5 overlap, trained andrea-tiny, verify's shapes
INT4_BROKEN_TOP5 = (0.40, 0.53)  # nibbles swapped (one token), one layer's nibbles swapped (lowest)
INT4_120M_LOGIT_ERR = (0.13, 0.85)  # int4's logit error on the random ANDREA-120M: mean, max
# max KL: fp32 trained; fp16 emulated; bf16 the earlier training; int8 MatMulNBits on the Intel demo; int4 Q/DQ
MAX_KL_MEASURED = {"fp32": 6e-13, "fp16": 7.8e-6, "bf16": 1.3e-3, "int8": 1.7e-3, "int4": 9.0e-2}
KL_MARGIN = {"fp32": 7, "fp16": 7, "bf16": 7, "int8": 3.3, "int4": 3.3}  # "times >= 7, int8 and int4 >= 3.3"
FP16_KL_ORT, BF16_KL, INT4_KL = 1.2e-6, 4.5e-4, 5.5e-2  # the next precision's KL, each on the trained model
WRONG_KERNEL_KL, BROKEN_INT4_KL = 1e-1, 3.5  # "A wrong kernel gives 1e-1 and up; a broken int4 graph 3.5 and up"
# perplexity drift on held-out text (int4: the graphs kept; amax / 7 Q/DQ, not kept, drifted 1.8e-2)
PPL_MEASURED = {"fp32": 7e-9, "fp16": 1.9e-5, "bf16": 2.9e-4, "int8": 5.0e-4, "int4": 8.3e-3}
PPL_MARGIN = {"fp32": 17, "fp16": 17, "bf16": 17, "int8": 17, "int4": 5}  # fp16 / bf16: ">= 17x margin"
# the drift each precision must fail: 0.5 % "is already a defect"; the goals, int8 1 %, int4 5 %
PPL_DEFECT = {"fp32": FP32_BAR, "fp16": 5e-3, "bf16": 5e-3, "int8": 1e-2, "int4": 5e-2}

# The bounds these tests were written for: a change has to pass the margin tests below, with the measurement and
# the margin it rests on updated here and in thresholds.py's comments, and then this table.
WRITTEN_FOR = {
    "TOLERANCES": {"fp32": {"rtol": 1e-4, "atol": 1e-4}, "fp16": {"rtol": 1e-2, "atol": 3e-2},
                   "bf16": {"rtol": 2e-2, "atol": 4e-1}, "int8": {"rtol": 5e-2, "atol": 6e-1},
                   "int4": {"rtol": 2e-1, "atol": 5.0}},
    "MIN_TOP1": {"fp32": 0.999, "fp16": 0.99, "bf16": 0.95, "int8": 0.9},
    "TOP1_TIE": {"bf16": 0.05},
    "MIN_TOP5": {"int4": 0.6},
    "TOP5_TIE": {"int4": 0.25},
    "MAX_KL": {"fp32": 1e-6, "fp16": 1e-4, "bf16": 1e-2, "int8": 6e-3, "int4": 3e-1},
    "MAX_PPL_REL": {"fp32": 1e-4, "fp16": 1e-3, "bf16": 5e-3, "int8": 1e-2, "int4": 5e-2},
}


# ---- Stand-in models: verify runs them like the PyTorch reference and an artifact ----

class _Fixed(torch.nn.Module):
    """Logits fixed in advance ([T, V], the same for every batch row), whatever the ids."""

    def __init__(self, logits: np.ndarray):
        super().__init__()
        self.logits = torch.from_numpy(np.asarray(logits, dtype=np.float32))
        self.cfg = types.SimpleNamespace(name="synthetic", n_positions=self.logits.shape[0],
                                         vocab_size=self.logits.shape[1])

    def forward(self, ids):
        return self.logits[: ids.shape[1]].expand(ids.shape[0], -1, -1)


class _Uniform(torch.nn.Module):
    """Uniform next-token logits over V tokens (perplexity V on any text), token 0 raised by `lift` on windows of
    `window` tokens only (verify's shapes then see the reference's logits): on text without token 0 the perplexity
    is V - 1 + exp(lift)."""

    def __init__(self, vocab: int, window: int, lift: float = 0.0):
        super().__init__()
        self.vocab, self.window, self.lift = vocab, window, lift
        self.cfg = types.SimpleNamespace(name="synthetic", n_positions=window, vocab_size=vocab)

    def forward(self, ids):
        logits = torch.zeros(*ids.shape, self.vocab)
        if ids.shape[1] == self.window:
            logits[..., 0] = self.lift
        return logits


def _verify(precision: str, ref: np.ndarray, outs: dict[str, np.ndarray]) -> dict[str, dict]:
    """verify's judgement of each artifact's logits against the reference's, on one shape: artifact -> its shape
    entry, with lm_ok (lm_passed on the next-token figures verify computed: the logit check aside)."""
    report = verify(_Fixed(ref), {name: TorchRunner(_Fixed(out), name) for name, out in outs.items()},
                    precision=precision, shapes=[(1, ref.shape[0])], greedy_steps=0, quiet=True)
    judged = {}
    for c in report.comparisons:
        (s,) = c["shapes"]
        judged[c["artifact"]] = {**s, "lm_ok": lm_passed(s, report.lm_thresholds), "comparison_passed": c["passed"]}
    return judged


def _at_least(value: float, floor: float) -> bool:
    return value >= floor * (1 - 1e-9)  # products of decimal figures round either way


# ---- Inside passes, beyond fails: the logit tolerances ----

@pytest.mark.parametrize("precision", PRECISIONS)
def test_atol_an_error_just_inside_passes_and_just_beyond_fails(precision):
    """Small logits (|logit| <= 0.7 atol) shifted by +-0.99 / 1.01 atol: their relative error (>= 0.58) exceeds
    every rtol, so atol alone decides; a shift leaves every next-token figure as it is."""
    atol = TOLERANCES[precision]["atol"]
    ref = np.tile(-0.1 * atol * np.arange(8), (4, 1))
    outs = {f"{sign:+d}x{f}": ref + sign * f * atol for f in (0.99, 1.01) for sign in (1, -1)}
    judged = _verify(precision, ref, outs)
    for name, s in judged.items():
        inside = name.endswith("0.99")
        assert s["logits_within_tolerance"] is inside and s["comparison_passed"] is inside, (name, s["max_abs"])
        assert s["top1_agreement"] == 1.0 and s["lm_ok"]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_rtol_an_error_just_inside_passes_and_just_beyond_fails(precision):
    """Artifact logits of at least R = 100 atol / rtol, the reference's off by +-0.99 / 1.01 rtol x R: the absolute
    error (~100 atol) exceeds atol, so rtol alone decides. Relative to the ARTIFACT's logit (Polygraphy's rule): at
    int4 and bf16 the inside case with the reference below fails if taken relative to the reference."""
    rtol, atol = TOLERANCES[precision]["rtol"], TOLERANCES[precision]["atol"]
    big = 100 * atol / rtol
    art = np.tile(big * (1 + 0.01 * np.arange(8)), (4, 1))  # the smallest, `big`, decides
    refs = {f"{sign:+d}x{f}": art - sign * f * rtol * big for f in (0.99, 1.01) for sign in (1, -1)}
    for name, ref in refs.items():  # one reference each: verify takes one
        (s,) = _verify(precision, ref, {"artifact": art}).values()
        inside = name.endswith("0.99")
        assert s["logits_within_tolerance"] is inside and s["comparison_passed"] is inside, (name, s["max_rel"])


def test_an_element_fails_only_where_both_errors_exceed_not_numpy_allclose():
    """What verify's logit check is (Polygraphy's elemwise rule): an element fails where |error| > atol AND |error| >
    rtol x |artifact logit|. thresholds.py's docstring says numpy.allclose (|error| <= atol + rtol x |reference|),
    which would pass these: bf16 at a reference logit of 16.3 (the trained model's largest), an error of 0.6 is
    inside allclose's 0.4 + 0.33 but beyond both of verify's bounds."""
    tol = TOLERANCES["bf16"]
    ref = np.tile(np.linspace(LARGEST_LOGIT - 1, LARGEST_LOGIT, 8), (2, 1))
    out = ref - 0.6
    assert np.allclose(out, ref, rtol=tol["rtol"], atol=tol["atol"])
    (s,) = _verify("bf16", ref, {"artifact": out}).values()
    assert not s["logits_within_tolerance"]


# ---- Inside passes, beyond fails: the next-token figures ----

def _flip_rows(n: int, flips: int, margin: float, vocab: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """n positions whose reference leads token 1 with token 0 by `margin`; the artifact swaps the two at the first
    `flips` positions (its top-1 flips there; the top 5 stay)."""
    ref = np.tile(np.concatenate([[margin, 0.0], -3.0 - 0.1 * np.arange(vocab - 2)]), (n, 1))
    out = ref.copy()
    out[:flips, [0, 1]] = ref[:flips, [1, 0]]
    return ref, out


@pytest.mark.parametrize("precision", sorted(MIN_TOP1))
def test_min_top1_a_share_just_inside_passes_and_just_beyond_fails(precision):
    """2000 positions, one flip fewer and one more than the floor allows; each flip's reference margin is twice
    the precision's TOP1_TIE (1e-4 without one), so it counts, with KL far inside MAX_KL."""
    n, floor = 2000, MIN_TOP1[precision]
    margin = 2 * TOP1_TIE.get(precision, 5e-5)
    allowed = round((1 - floor) * n)
    for flips in (allowed - 1, allowed + 1):
        ref, out = _flip_rows(n, flips, margin)
        (s,) = _verify(precision, ref, {"a": out}).values()
        assert s["top1_beyond_ties"] == pytest.approx(1 - flips / n) and s["max_kl"] <= MAX_KL[precision]
        assert s["lm_ok"] is (flips < allowed), (flips, s["top1_beyond_ties"])


def test_int4_has_no_top1_floor():
    """On random ids int4's top-1 flips at a quarter to a third of positions: every position flipped, the top 5 kept,
    passes int4's next-token gate."""
    ref, out = _flip_rows(16, 16, 0.3)
    (s,) = _verify("int4", ref, {"a": out}).values()
    assert "int4" not in MIN_TOP1 and s["top1_agreement"] == 0.0 and s["lm_ok"]


@pytest.mark.parametrize("precision", sorted(MIN_TOP1))
def test_top1_tie_a_flip_just_inside_is_forgiven_and_just_beyond_counts(precision):
    """One position, flipped: forgiven (bf16 only) where the reference's margin is 0.9 TOP1_TIE, counted at 1.1;
    the raw top1_agreement stays 0 in the report. Without a tie, a flip at a 1e-4 margin counts."""
    tie = TOP1_TIE.get(precision, 0.0)
    for f in (0.9, 1.1):
        margin = f * tie if tie else 1e-4
        ref, out = _flip_rows(1, 1, margin)
        (s,) = _verify(precision, ref, {"a": out}).values()
        forgiven = bool(tie) and f < 1
        assert s["top1_agreement"] == 0.0 and s["lm_ok"] is forgiven, (precision, f, s["top1_beyond_ties"])
        assert not forgiven or s["comparison_passed"]  # bf16's logits, 0.045 off, are within its tolerance
    assert set(TOP1_TIE) == {"bf16"}, "a precision got a top-1 tie: give it a measured flip and a test"


def _top5_rows(misses: list[int], vocab: int = 512) -> tuple[np.ndarray, np.ndarray]:
    """One position per entry: the reference's top 5 (3.0 .. 2.6) lead the next 5 (2.0 .. 1.6) by >= 0.6 (beyond
    any tie), the rest at 0; the artifact swaps the first `m` of the top 5 with their runners-up (m misses). Each swap
    adds ~0.02 nats of KL (a large vocabulary keeps the ten tokens' mass small)."""
    row = np.zeros(vocab)
    row[:5], row[5:10] = 3.0 - 0.1 * np.arange(5), 2.0 - 0.1 * np.arange(5)
    ref = np.tile(row, (len(misses), 1))
    out = ref.copy()
    for i, m in enumerate(misses):
        out[i, :m], out[i, 5:5 + m] = ref[i, 5:5 + m], ref[i, :m]
    return ref, out


def test_min_top5_a_share_just_inside_passes_and_just_beyond_fails():
    """10 positions, 50 top-5 tokens: 19 missed (0.62) passes int4's floor of 0.6, 21 missed (0.58) fails."""
    floor = MIN_TOP5["int4"]
    allowed = round((1 - floor) * 50)
    for missed in (allowed - 1, allowed + 1):
        ref, out = _top5_rows([2] * 9 + [missed - 18])
        (s,) = _verify("int4", ref, {"a": out}).values()
        assert s["top5_beyond_ties"] == pytest.approx(1 - missed / 50) and s["max_kl"] <= MAX_KL["int4"]
        assert s["lm_ok"] is (missed < allowed), (missed, s["top5_beyond_ties"])


def test_top5_tie_a_miss_just_inside_is_forgiven_and_just_beyond_counts():
    """One position whose artifact drops 3 of the reference's top 5 (raw overlap 0.4, under the 0.6 floor) for
    tokens the reference puts 0.9 / 1.1 TOP5_TIE lower: forgiven, passing, at 0.9; counted, failing, at 1.1."""
    tie = TOP5_TIE["int4"]
    for f in (0.9, 1.1):
        row = np.full(16, -5.0)
        row[:2], row[2:5], row[5:8] = (10.0, 9.0), 5.0, 5.0 - f * tie
        ref = row[None]
        out = ref.copy()
        out[0, 2:5], out[0, 5:8] = ref[0, 5:8], ref[0, 2:5]
        (s,) = _verify("int4", ref, {"a": out}).values()
        assert s["top5_overlap"] == pytest.approx(0.4) and s["lm_ok"] is (f < 1), (f, s["top5_beyond_ties"])
    assert set(TOP5_TIE) == {"int4"}, "a precision got a top-5 tie: give it a measured swap and a test"


def _raised(kl: float, vocab: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Two positions: the first the same in both; at the second the artifact raises the reference's top token by
    the `a` that makes KL(reference || artifact) = kl (top 1 and top 5 unchanged)."""
    ref = np.tile(-0.5 * np.arange(vocab), (2, 1))
    p0 = 1 / np.exp(ref[0]).sum()
    lo, hi = 0.0, 20.0
    for _ in range(200):  # KL(a) = log(1 + p0 (e^a - 1)) - a p0 grows with a > 0
        a = (lo + hi) / 2
        lo, hi = (a, hi) if math.log1p(p0 * math.expm1(a)) - a * p0 < kl else (lo, a)
    out = ref.copy()
    out[1, 0] += (lo + hi) / 2
    return ref, out


@pytest.mark.parametrize("precision", PRECISIONS)
def test_max_kl_just_inside_passes_and_just_beyond_fails(precision):
    """KL(reference || artifact) of 0.9 / 1.1 MAX_KL at one position of two: verify reports the worst position's
    (in that direction: at int4's 1.1x the reverse, 0.296, would pass) and its gate decides on it alone."""
    bound = MAX_KL[precision]
    for f in (0.9, 1.1):
        ref, out = _raised(f * bound)
        (s,) = _verify(precision, ref, {"a": out}).values()
        assert s["max_kl"] == pytest.approx(f * bound, rel=1e-3) and s["top1_agreement"] == s["top5_overlap"] == 1.0
        assert s["lm_ok"] is (f < 1), (precision, f, s["max_kl"])


# ---- Inside passes, beyond fails: perplexity on text ----

@pytest.mark.parametrize("precision", PRECISIONS)
def test_max_ppl_rel_a_drift_just_inside_passes_and_just_beyond_fails(precision):
    """verify with evaluation windows: the reference's perplexity is V = 16 (uniform); the artifacts' moves by
    +-0.9 / 1.1 MAX_PPL_REL relative (token 0, absent from the text, raised or lowered: V - 1 + exp(lift)). Only
    the perplexity differs, so it alone decides each comparison."""
    vocab, window, bound = 16, 8, MAX_PPL_REL[precision]
    wins = np.random.default_rng(0).integers(1, vocab, size=(3, window)).astype(np.int64)
    rels = {f"{sign:+d}x{f}": sign * f * bound for f in (0.9, 1.1) for sign in (1, -1)}
    arts = {name: TorchRunner(_Uniform(vocab, window, math.log1p(rel * vocab)), name) for name, rel in rels.items()}
    report = verify(_Uniform(vocab, window), arts, precision=precision, shapes=[(1, 2)], greedy_steps=0,
                    eval_windows=wins, quiet=True)
    assert report.perplexity["reference"] == {"pytorch": pytest.approx(vocab)}
    for c in report.comparisons:
        inside = c["artifact"].endswith("0.9")
        assert c["perplexity"]["rel_diff"] == pytest.approx(rels[c["artifact"]], rel=1e-4)
        assert c["perplexity"]["passed"] is inside and c["passed"] is inside, c
        assert all(s["passed"] for s in c["shapes"])
    assert report.passed is False


# ---- Each bound between the error measured and the defect it must catch ----

@pytest.mark.parametrize("precision", PRECISIONS)
def test_logit_tolerances_keep_their_margin_over_the_measured_error(precision):
    """Tightening a tolerance fails graphs that are right: re-measure first (thresholds.py's tables)."""
    tol = TOLERANCES[precision]
    need, margin = ATOL_NEEDED[precision], ATOL_MARGIN[precision]
    assert _at_least(tol["atol"], margin * need), (
        f"{precision} atol {tol['atol']:g} is {tol['atol'] / need:.2f}x the atol its graphs needed ({need:g}); "
        f"thresholds.py keeps >= {margin}x")
    assert tol["atol"] >= MAX_ERR[precision], (
        f"{precision} atol {tol['atol']:g} is under the largest error measured ({MAX_ERR[precision]:g}): that "
        f"graph now passes only where rtol covers it")


@pytest.mark.parametrize("precision", PRECISIONS)
def test_logit_tolerances_fail_the_error_of_a_defect(precision):
    """Loosening a tolerance lets through the defect it is there for. fp32: the foundation issue's 1e-4. fp16: an
    fp16 graph that computes in bf16 (bf16's 0.12 must fail). fp16, bf16: a wrong kernel moves logits by whole
    units (what the tolerance allows at the largest logit must stay under 1). int8: an int8 graph quantized to 4
    bits (int4's 1.67). int4: an all-zero output (what it allows at the largest logit, 16.3, must stay under it)."""
    tol = TOLERANCES[precision]
    at_largest = max(tol["atol"], tol["rtol"] * LARGEST_LOGIT)  # verify's rule: atol OR rtol x |logit|
    if precision == "fp32":
        assert tol["atol"] <= FP32_BAR and tol["rtol"] <= FP32_BAR, f"fp32 {tol}: over the issue's bar of 1e-4"
    if precision == "fp16":
        assert tol["atol"] < BF16_ATOL_NEEDED, f"fp16 atol {tol['atol']:g} passes a graph computing in bf16"
    if precision in ("fp16", "bf16"):
        assert at_largest < WHOLE_UNIT, f"{precision} {tol} lets a logit of 16.3 move {at_largest:.2f}: a wrong kernel"
    if precision == "int8":
        assert at_largest < INT4_MAX_ERR, f"int8 {tol} allows {at_largest:.2f}: int4's error ({INT4_MAX_ERR}) passes"
    if precision == "int4":
        assert at_largest < LARGEST_LOGIT, f"int4 {tol} allows {at_largest:.2f}: an all-zero output passes"


def test_the_measured_logit_error_passes_and_the_defects_fail_through_verify():
    """The same through verify at a small logit: bf16 off by its worst measured error times 2.5 passes, by one whole
    unit fails; int4 all zeros where the reference reaches 16.3 fails."""
    ref = np.tile(-0.01 * np.arange(8), (2, 1))
    measured = ref + 2.5 * ATOL_NEEDED["bf16"] * 0.999
    judged = _verify("bf16", ref, {"measured": measured, "wrong kernel": ref + WHOLE_UNIT})
    assert judged["measured"]["logits_within_tolerance"] and not judged["wrong kernel"]["logits_within_tolerance"]
    ref = np.tile(np.linspace(LARGEST_LOGIT - 10, LARGEST_LOGIT, 8), (2, 1))
    (s,) = _verify("int4", ref, {"zeros": np.zeros_like(ref)}).values()
    assert not s["logits_within_tolerance"]


@pytest.mark.parametrize("precision", sorted(MIN_TOP1))
def test_top1_floors_sit_between_the_flips_measured_and_a_defects(precision):
    """The share of flips a floor allows (1 - MIN_TOP1): fp32 > 0 (GPU engines reorder reductions: a near-tie may
    flip) and under fp16's flips (an fp32 graph computing in fp16 fails); fp16 >= 2.5x its flips and under bf16's
    fewest; bf16 >= 1.3x its flips (its near-ties are forgiven besides) and <= 2x (more lets a defect flip as many
    again); int8 >= 2.5x and <= 3x its flips (its logit bounds' "about 3x")."""
    allows, flips = 1 - MIN_TOP1[precision], TOP1_MISSES[precision]
    low, high = {"fp32": (0.0, FP16_TOP1_MISSES_TRAINED), "fp16": (2.5 * flips, BF16_TOP1_MISSES_TEXT),
                 "bf16": (1.3 * flips, 2 * flips), "int8": (2.5 * flips, 3 * flips)}[precision]
    assert allows > 0 and _at_least(allows, low), (
        f"{precision} MIN_TOP1 {MIN_TOP1[precision]} allows {allows:.3%} flips: under {low:.3%}, fails right graphs")
    assert allows <= high * (1 + 1e-9) and (precision not in ("fp32", "fp16") or allows < high), (
        f"{precision} MIN_TOP1 {MIN_TOP1[precision]} allows {allows:.3%} flips: over {high:.3%}, passes a defect")


def test_top1_tie_sits_between_the_flips_measured_and_a_defects():
    """bf16's TOP1_TIE forgives the flips measured on Intel AMX (margins to 0.0086; 2.5x kept), stays under that
    machine's own bf16 logit error (0.05) and far under a wrong kernel's whole units."""
    tie = TOP1_TIE["bf16"]
    assert tie >= 2.5 * max(BF16_FLIPPED_MARGINS), f"TOP1_TIE {tie}: the measured bf16 flips fail again"
    assert tie <= BF16_AMX_LOGIT_ERR and tie < WHOLE_UNIT, f"TOP1_TIE {tie}: over bf16's own logit error"


def test_top5_floor_and_tie_sit_between_the_misses_measured_and_a_defects():
    """int4's MIN_TOP5 lets it miss 2.5x the share it misses (1 - 0.844) and fails the broken graphs (nibbles
    swapped: 0.40 .. 0.53 and lower); TOP5_TIE forgives swaps within int4's mean logit error (0.13), stays under its
    largest (0.85) and a broken graph's whole units."""
    floor, tie = MIN_TOP5["int4"], TOP5_TIE["int4"]
    assert _at_least(1 - floor, 2.5 * (1 - INT4_TOP5)), f"MIN_TOP5 {floor}: int4's measured top-5 loses its margin"
    assert floor > max(INT4_BROKEN_TOP5), f"MIN_TOP5 {floor}: a broken int4 graph's top-5 passes"
    assert tie >= INT4_120M_LOGIT_ERR[0], f"TOP5_TIE {tie}: under int4's mean logit error, its own swaps count"
    assert tie <= INT4_120M_LOGIT_ERR[1] and tie < WHOLE_UNIT, f"TOP5_TIE {tie}: forgives a broken graph's swaps"


@pytest.mark.parametrize("precision", PRECISIONS)
def test_max_kl_sits_between_the_kl_measured_and_a_defects(precision):
    """MAX_KL keeps thresholds.py's margin over the worst KL measured (>= 7x; int8, int4 >= 3.3x) and fails the
    defect: fp32 a graph computing in fp16 (1.2e-6), fp16 one in bf16 (4.5e-4), int8 one quantized to 4 bits
    (5.5e-2); bf16 and int4 stay nearer their own error than a wrong kernel's (1e-1) / a broken int4 graph's (3.5)
    on a log scale (under the geometric mean of the two)."""
    bound, worst, margin = MAX_KL[precision], MAX_KL_MEASURED[precision], KL_MARGIN[precision]
    assert _at_least(bound, margin * worst), f"{precision} MAX_KL {bound:g}: {bound / worst:.2g}x its worst {worst:g}"
    defect = {"fp32": FP16_KL_ORT, "fp16": BF16_KL, "int8": INT4_KL}.get(precision)
    if defect is None:
        defect = math.sqrt(worst * (WRONG_KERNEL_KL if precision == "bf16" else BROKEN_INT4_KL))
    assert bound < defect, f"{precision} MAX_KL {bound:g} passes a defect's KL ({defect:.2g})"


@pytest.mark.parametrize("precision", PRECISIONS)
def test_max_ppl_rel_sits_between_the_drift_measured_and_a_defects(precision):
    """MAX_PPL_REL keeps >= 17x over the drift measured (int4 >= 5x: 6.0x over its kept graphs) and stays within
    what is already a defect: 0.5 % for the float precisions (fp32 the issue's 1e-4), the issue's goals for int8
    (1 %) and int4 (5 %)."""
    bound, worst, margin = MAX_PPL_REL[precision], PPL_MEASURED[precision], PPL_MARGIN[precision]
    assert _at_least(bound, margin * worst), f"{precision} MAX_PPL_REL {bound:g}: {bound / worst:.2g}x its {worst:g}"
    defect = PPL_DEFECT[precision]
    assert bound <= defect, f"{precision} MAX_PPL_REL {bound:g} passes a drift of {defect:g}"


def test_the_bounds_are_the_ones_these_tests_were_written_for():
    """Any change to a bound, however small, comes here: check it against its measurement above and in
    thresholds.py's comments (both updated), then change WRITTEN_FOR."""
    now = {name: getattr(thresholds, name) for name in WRITTEN_FOR}
    assert now == WRITTEN_FOR

"""What verification lets through, per precision: logit tolerances, top-1 / top-5 agreement, KL divergence of
next-token distributions and perplexity drift; the ONE place they live, each with the measurement it comes from.

How a logit is judged against TOLERANCES: the graph comparisons (compare.verify, Polygraphy's elementwise check)
fail an element only where |artifact - reference| > atol and > rtol * |artifact| both; the step-by-step decoder
and engine checks use numpy.allclose, |artifact - reference| <= atol + rtol * |reference|
(tests/verify/test_thresholds.py pins both).
"""

from typing import Any

# Measured against PyTorch float32 on batch 4 x seq 128 (512 tokens). Trained: andrea-tiny trained on
# the Python docs (demo.py; held-out perplexity 343.8; logit std 2.2, max |logit| 16.3), on random ids
# and on held-out text. Random: random_init(seed=0) weights (logit std 0.16 tiny / 0.55 120M, max
# |logit| 1.2 / 2.9), random ids.
#
#   graph                      trained max|err|   top-1    max KL    atol needed   120M random max|err|
#                              ids / text         (ids)    (ids)     (ids)         (atol needed), top-1
#   fp32, ONNX Runtime CPU     9.5e-6 / 8.1e-6    100 %    6e-13     3.7e-6        3.0e-6, 100 %
#   fp16, ONNX Runtime CPU     9.4e-3 / 7.7e-3    100 %    1.2e-6    5.3e-3        2.1e-3, 100 %
#   fp16, emulate_in_fp32      1.9e-2 / 1.4e-2    99.8 %   7.8e-6    8.6e-3        4.1e-3 (3.6e-3), 99.6 %
#   bf16, emulate_in_fp32      1.7e-1 / 1.3e-1    97.1 %   4.5e-4    1.2e-1        3.3e-2 (2.9e-2), 96.3 %
#   (top-1 on text: fp16 emulated 99.8 %, bf16 97.9 %; "atol needed" at the rtol below. An earlier
#    training of the same model, before the corpus was reflowed, needed 1.3e-2 and 1.6e-1 and reached
#    max KL 1.3e-3 in bf16. onnxconverter-common fp16 gave the same numbers as this pass on the random
#    120M, to 3 digits)
#
# Perplexity on the 7,747 predicted held-out tokens, through the exported graphs: fp32 343.8262
# (PyTorch 343.8262, +7e-9), fp16 ORT -1.9e-5, fp16 emulated -9.1e-6, bf16 emulated +2.9e-4 relative.
#
# The trained model's logits are 4-5x larger than random ones, and so are its errors: the bounds
# measured on random weights (fp16 atol 1e-2, bf16 atol 8e-2 and max KL 1e-3) failed it or left no
# margin. ORT's CPU provider has no bf16 kernels, so bf16 is measured with emulate_in_fp32 (every op
# rounded to bf16: pessimistic next to a GPU's fused kernels; for fp16 it reads ~2x ORT's error). The
# bounds below leave >= 2.5x margin over the worst measurement of either training. fp32's bound is
# far above the CPU's 1e-5 on purpose: GPU engines reorder reductions and may evaluate tanh/exp with
# approximate instructions; tighten it from GPU runs.
# fp32 is held to 1e-4 (the foundation issue's bar: about 1e-4 relative on the logits).
#
# Weight-only int8 / int4 (quantize.py: ONNX Runtime's MatMulNBits, symmetric round-to-nearest, blocks of
# 128 along K where K allows (andrea-tiny: 64 where K = 64), int4's tied head in blocks of 32, accuracy_level
# 4: int8 x int8 products), ONNX Runtime CPU (AVX-512 VNNI), trained andrea-tiny, the build's default shapes
# (worst of them; int4's top-1 at the one-token shape is 0 or 1, so the next worst is given too):
#
#   graph        max|err|      top-1     max KL     perplexity (held-out text, vs PyTorch fp32 343.83)
#   int8         0.190         96.9 %    1.2e-3     343.99 (+4.7e-4)
#   int4         1.67          69.1 %    5.5e-2     346.69 (+8.3e-3)
#   int4 in asymmetric blocks of 64 with searched ranges, the demo's head at 8 bits where its error sits
#   (quantize.choose_head_bits): top-1 worst 91.0 % (next 94.5 %), max KL 1.8e-2, perplexity 344.08 (+7.4e-4);
#   its engine's Q/DQ graph (head int8 per column) 344.65 (+2.4e-3). The bounds below hold both forms, and a
#   broken int4 graph fails them.
#   int4 solved by GPTQ (quantize.solve_int4), the demo's head then at 4 bits (it makes 40 % of the error),
#   shape [2, 32]: top-1 98.4 %, max KL 2.1e-3, perplexity 344.60 (+2.3e-3); its Q/DQ graph 100 %, 1.1e-3,
#   344.70 (+2.5e-3). (The head at 8 bits with GPTQ: +9.7e-4 and +3.2e-4, for 16 % more weight bytes.)
#   (blocks of 64 / 32 until 2026-12-02: int8 0.221, 96.5 %, 8.7e-4, +5.0e-4; int4 1.50, 64.1 %, 2.5e-2,
#   +6.3e-3. The larger blocks make int4's decode 15-19 % faster: quantize.py.)
#
# (Before accuracy_level 4, with weights dequantized to float32 in the product: int8 0.127, 98.2 %,
# 1.6e-4, +2.7e-4; int4 1.68, 63.1 %, 3.5e-2, +6.1e-3.)
#
# The engines' Q/DQ graphs (quantize.to_qdq: TensorRT's form, quantized from the fp32 weights, float32
# activations) against the MatMulNBits graphs, on the demo as trained on an Intel Xeon (another CPU's
# rounding trains other weights: held-out perplexity 301.18), verify's default shapes, random ids:
#
#   graph                                         max|err|   top-5    max KL     perplexity
#   int8 MatMulNBits, blocks of 64, level 4       0.338      0.976    1.7e-3     -8.2e-5
#   int8 Q/DQ per output column (TensorRT)        0.157      0.988    2.2e-4     +1.7e-4
#   int8 Q/DQ blocks of 64, re-signed (RTX only)  0.234      0.988    7.8e-4     +2.2e-4   (TensorRT refuses)
#   int4 MatMulNBits, blocks of 32, level 4       1.76       0.800    5.9e-2     +4.6e-3
#   int4 Q/DQ, ORT's signed scales (RTX only)     1.77       0.800    5.3e-2     +4.8e-3   (TensorRT refuses)
#   int4 Q/DQ, ORT's blocks re-signed, -8 -> 7    2.65       0.887    1.2e-1     +1.3e-2
#   int4 Q/DQ, amax / 7 (ModelOpt's RTN)          2.29       0.871    2.0e-1     +1.8e-2
#   int4 Q/DQ, amax / 8, [-8, 7]                  2.57       0.800    1.3e-1     +1.3e-2
#   int4 Q/DQ, scale searched (TensorRT, kept)    2.42       0.898    9.0e-2     +7.6e-3
#
# Positive scales cost int4 accuracy (a block's positive extreme gets 7 steps, not 8); the per-block search
# of quantize.SCALE_SEARCH recovers most of it. Broken int4 Q/DQ graphs, same measurement: one weight's
# scales doubled max KL 3.5, one weight negated 6.7. Their logit bounds are about 3x the worst measurement
# (random ids are where the tiny model's next-token distribution is flattest, so top-1 flips most: on
# held-out text int4 keeps far more); their perplexity bounds are the goals: int8 within 1 %,
# int4 within 5 % of fp32.
# np.allclose's rtol and atol, handed on as `**TOLERANCES[precision]` (Any: to checks that take other arguments too)
TOLERANCES: dict[str, dict[str, Any]] = {
    "fp32": dict(rtol=1e-4, atol=1e-4),
    "fp16": dict(rtol=1e-2, atol=3e-2),
    "bf16": dict(rtol=2e-2, atol=4e-1),
    "int8": dict(rtol=5e-2, atol=6e-1),
    "int4": dict(rtol=2e-1, atol=5.0),
}
# Least share of positions whose top-1 token must agree with the reference (same measurements).
# int4 has no top-1 floor: on random ids its top-1 flips at a quarter to a third of positions, and
# verify's one-token shape is then 0 or 1 (measured 0: the floor used to be 0, which gated nothing).
MIN_TOP1 = {"fp32": 0.999, "fp16": 0.99, "bf16": 0.95, "int8": 0.9}
# A top-1 flip that bf16 may make: where the fp32 reference puts the artifact's token within this many
# logits of its own, the flip counts as agreement (compare.lm_metrics' top1_beyond_ties; top1_agreement stays
# raw in the report). bf16's arithmetic differs by CPU (AMX, AVX512-BF16, ONNX Runtime's emulation): the
# trained tiny model through OpenVINO in bf16 on an Intel AMX machine flipped positions whose reference
# margins were 0.0028, 0.0058 and 0.0086 logits, its logits being 0.05-0.15 off (KL <= 2e-5), and one such
# flip in verify's 3-token shape failed the 0.95 floor. 0.05: below that measured bf16 error, far below a
# real defect (a wrong kernel moves logits by whole units, and KL catches it). Other precisions: none.
TOP1_TIE = {"bf16": 0.05}
# Least top-5 overlap (the share of the reference's 5 likeliest tokens among the artifact's), for int4
# in place of top-1. Trained andrea-tiny, verify's default shapes and seed, ONNX Runtime CPU: int4
# 0.844 .. 1.0 (text 0.941); broken int4 graphs: nibbles swapped 0.05 .. 0.11 (0.40 on one token),
# one layer's nibbles swapped 0.53 .. 0.63, scales doubled 0.48 .. 0.78. 0.6 lets int4 miss 2.5x the
# share it misses and fails the first two at every shape of more than one token (KL fails them too).
MIN_TOP5 = {"int4": 0.6}
# A top-5 miss that int4 may make: where the reference puts the token int4 dropped from its top 5 within this
# many logits of int4's lowest pick (by the reference's own logits), the miss counts as agreement
# (compare.lm_metrics' top5_beyond_ties; top5_overlap stays raw in the report). Random weights give a nearly
# flat distribution: on the random ANDREA-120M (blocks of 128, verify's shapes) the reference's 5th and 6th
# tokens are 0.023 logits apart (median) and int4's logits 0.13 off (mean; max 0.85), so int4 swapped 42 % of
# the top-5 tokens and the default `build --precision int4` failed 0.6 with max KL 0.02. Forgiven at
# ties of 0.1 / 0.25 / 0.5: 0.61 / 0.77 / 0.98 of them. 0.25: under int4's measured error, far under a broken
# graph's (its logits move by whole units; the trained model's raw top-5 >= 0.84 is what it was).
TOP5_TIE = {"int4": 0.25}
# Largest KL(reference || artifact) of a next-token distribution, in nats, over all positions: the
# trained models' worst above times >= 7, int8 and int4 >= 3.3 (random weights: fp32 3e-13, fp16 3e-9,
# bf16 7e-7). A wrong kernel gives 1e-1 and up; a broken int4 graph 3.5 and up. int8 and int4 were 3e-3
# and 1e-1, which the Intel-trained demo's MatMulNBits int8 (1.7e-3) and Q/DQ int4 (9.0e-2) came within
# 1.8x and 1.1x of. The engine gate (verify/engine.py) holds the engines' decoding to the same bounds.
MAX_KL = {"fp32": 1e-6, "fp16": 1e-4, "bf16": 1e-2, "int8": 6e-3, "int4": 3e-1}
# Largest relative difference of an artifact's perplexity on real text from PyTorch fp32's (verify with
# an evaluation text: build --tokenizer --eval-text). Measured above: fp16 1.9e-5, bf16 2.9e-4; the
# bounds leave >= 17x margin (the issue asks for 1 %; a drift of 0.5 % is already a defect).
MAX_PPL_REL = {"fp32": 1e-4, "fp16": 1e-3, "bf16": 5e-3, "int8": 1e-2, "int4": 5e-2}

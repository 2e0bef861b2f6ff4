"""The scenarios and the work each cannot avoid: the grids of shapes, FLOPs and bytes of a forward pass,
the roofline floor, and the inputs every backend gets (the same arrays)."""

from __future__ import annotations

import numpy as np

from ..config import ModelConfig
from ..names import WEIGHT_ONLY

SCENARIOS = ("prefill", "decode", "generate")

# Full grids (clipped to the model's context). (batch, seq) / (batch, past) / (batch, prompt, new tokens).
PREFILL_GRID = [(b, t) for b in (1, 4, 16) for t in (32, 128, 512, 1024)]
DECODE_GRID = [(1, 127)] + [(b, p) for b in (1, 8, 32) for p in (128, 512, 1023)]  # (1, 127): the goal's case
GENERATE_GRID = [(1, 128, 64), (8, 128, 64), (1, 32, 128), (8, 32, 128)]  # 32 + 128: the peers' goal case
QUICK_PREFILL_GRID = [(1, 32), (1, 128)]
QUICK_DECODE_GRID = [(1, 127), (8, 128)]
QUICK_GENERATE_GRID = [(1, 32, 16)]


def weight_bytes(cfg: ModelConfig, dtype_bytes: int = 4) -> int:
    """Bytes of all weights, the tied embedding counted once (ANDREA-120M fp32: 92,331,264 x 4)."""
    return cfg.n_params * dtype_bytes


def matmul_params(cfg: ModelConfig) -> int:
    """Weights that multiply every token: the 4 projections of each block (12 C^2) and the tied output
    projection (V C). Embedding lookups, biases and LayerNorms are not matmul work."""
    return cfg.n_layer * 12 * cfg.n_embd**2 + cfg.vocab_size * cfg.n_embd


def attention_flops(cfg: ModelConfig, batch: int, new: int, past: int = 0) -> int:
    """Causal attention: query i (of `new`) sees past + i + 1 keys; QK^T and AV each cost 2 C flops per
    (query, key) pair per layer (summed over heads)."""
    pairs = new * past + new * (new + 1) // 2
    return 2 * 2 * cfg.n_embd * pairs * batch * cfg.n_layer


def forward_flops(cfg: ModelConfig, batch: int, new: int, past: int = 0) -> int:
    """2 * matmul weights * tokens + attention FLOPs."""
    return 2 * matmul_params(cfg) * batch * new + attention_flops(cfg, batch, new, past)


def quantized_matmul_bytes(cfg: ModelConfig, precision: str) -> int:
    """Bytes of the matmul weights of the weight-only graph ORT runs (graphs/quantize.py: MatMulNBits): the
    packed integers plus one float32 scale per block along K (and int4's 4-bit zero point per block), each
    MatMul at its own block (quantize.block_for: K = n_embd or 4 n_embd; the head's block, at int4's 4 bits)."""
    from ..graphs.quantize import QUANT, block_for

    C, bits, zero_points = cfg.n_embd, QUANT[precision]["bits"], QUANT[precision]["zero_points"]

    def matmul(k: int, n: int, head: bool = False) -> float:
        block = block_for(k, precision, head=head)
        assert block is not None, "quantize.check_model_shape refuses a width no block divides"
        blocks = k // block  # per column: its integers, a float32 scale a block, its zero points packed (pack_nbits)
        return n * (k * bits / 8 + 4 * blocks + (-(-blocks * bits // 8) if zero_points else 0))

    body = cfg.n_layer * (matmul(C, 3 * C) + matmul(C, C) + matmul(C, 4 * C) + matmul(4 * C, C))  # qkv, proj, fc; fc2
    return int(body + matmul(C, cfg.vocab_size, head=True))


def forward_bytes(cfg: ModelConfig, batch: int, new: int, past: int = 0, write_kv: bool = True,
                  dtype_bytes: int = 4, precision: str = "fp32") -> int:  # fmt: skip
    """Bytes a forward pass must move at least once: every weight it uses (all of them, except the
    position rows it does not look up), the past KV cache read, the new tokens' K/V written (if the graph
    returns a cache) and the logits written. That is exactly the in-place decoder's step (the filled cache
    read once, the new rows written where they belong); a concatenating graph also copies the past into
    its present, which is avoidable, so not counted.

    `precision` "int8" / "int4": the weight-only graph, whose matmul weights (the output projection's
    quantized copy of the embedding included) are read at quantized_matmul_bytes, while the float32
    embedding table is only gathered from (one row per token) and biases and LayerNorms stay float32."""
    C, L = cfg.n_embd, cfg.n_layer
    used_positions = min(past + new, cfg.n_positions)
    if precision in WEIGHT_ONLY:
        tables = (cfg.vocab_size + cfg.n_positions) * C
        small = cfg.n_params - matmul_params(cfg) - tables + cfg.vocab_size * C  # + V C: tied, counted in both
        weights = quantized_matmul_bytes(cfg, precision) + 4 * (small + (batch * new + used_positions) * C)
    else:
        weights = (cfg.n_params - (cfg.n_positions - used_positions) * C) * dtype_bytes
    kv_read = 2 * L * batch * past * C * dtype_bytes
    kv_write = 2 * L * batch * new * C * dtype_bytes if write_kv else 0
    logits = batch * new * cfg.vocab_size * 4
    return weights + kv_read + kv_write + logits


# A time below this multiple of its floor beat the machine's measured limits: the limits or the sample were
# disturbed (the run warns; such a floor read is not held against anything)
DISTURBED_BELOW = 0.95


def floor_seconds(flops: float, nbytes: float, machine: dict) -> tuple[float, str]:
    """Roofline floor: (max(flops / matmul rate, bytes / bandwidth), which one binds)."""
    t_c = flops / (machine["matmul_GFLOPs"] * 1e9)
    t_m = nbytes / (machine["bandwidth_GBps"] * 1e9)
    return (t_c, "compute") if t_c >= t_m else (t_m, "memory")


def scenario_work(cfg: ModelConfig, scenario: str, batch: int, seq: int, past: int, new_tokens: int,
                  precision: str = "fp32") -> tuple[int, int]:  # fmt: skip
    """(FLOPs, bytes) of one timed call of a scenario (bytes of `precision`'s weights: forward_bytes)."""
    if scenario == "prefill":
        return forward_flops(cfg, batch, seq), forward_bytes(cfg, batch, seq, write_kv=False, precision=precision)
    if scenario == "decode":
        return forward_flops(cfg, batch, 1, past), forward_bytes(cfg, batch, 1, past, precision=precision)
    if scenario == "generate":  # the prompt, then new_tokens - 1 single-token steps
        flops = forward_flops(cfg, batch, seq)
        nbytes = forward_bytes(cfg, batch, seq, precision=precision)
        for p in range(seq, seq + new_tokens - 1):
            flops += forward_flops(cfg, batch, 1, p)
            nbytes += forward_bytes(cfg, batch, 1, p, precision=precision)
        return flops, nbytes
    raise ValueError(f"unknown scenario {scenario!r}")


def _clip(cfg: ModelConfig, scenario: str, grid):
    n = cfg.n_positions
    if scenario == "prefill":
        return [(b, min(t, n)) for b, t in dict.fromkeys(grid) if t <= n] or [(b, n) for b, _ in grid[:1]]
    if scenario == "decode":
        return [(b, p) for b, p in dict.fromkeys(grid) if p + 1 <= n]
    return [(b, t, k) for b, t, k in dict.fromkeys(grid) if t + k <= n]


def grid_cases(cfg, scenarios, prefill_grid, decode_grid, generate_grid):
    cases = []
    if "prefill" in scenarios:
        cases += [("prefill", b, t, 0, 0) for b, t in _clip(cfg, "prefill", prefill_grid)]
    if "decode" in scenarios:
        cases += [("decode", b, 1, p, 1) for b, p in _clip(cfg, "decode", decode_grid)]
    if "generate" in scenarios:
        cases += [("generate", b, t, 0, k) for b, t, k in _clip(cfg, "generate", generate_grid)]
    return cases


def case_inputs(cfg: ModelConfig, scenario: str, batch: int, seq: int, past: int, seed: int):
    """The same arrays for every backend: random token ids; for decode a random past KV cache."""
    rng = np.random.default_rng([seed, batch, seq, past, SCENARIOS.index(scenario)])
    ids = rng.integers(0, cfg.vocab_size, size=(batch, seq), dtype=np.int64)
    if scenario != "decode":
        return (ids,)
    shape = (batch, cfg.n_head, past, cfg.head_dim)
    kv = [rng.random(shape, dtype=np.float32) for _ in range(2 * cfg.n_layer)]  # uniform: cheaper, times the same
    return ids, np.ones((batch, past + 1), np.int64), kv

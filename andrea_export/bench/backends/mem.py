"""The decode floor read in the same rounds as the backends."""

from __future__ import annotations

import torch

from ..work import forward_bytes
from .base import Backend, Context


class MemReadBackend(Backend):
    """The decode floor, measured in the same interleaved rounds as the backends: a decode step must read
    every weight and the KV cache once, so this reads that many bytes (torch.sum over a float32 buffer
    of the step's `forward_bytes`, same threads). On a shared machine the bandwidth drifts by 1.5x
    within minutes; paired per iteration with a backend, median(t_backend / t_read) is that backend's
    multiple of the floor with the drift cancelled (`goals` reports it beside the start/end floor).
    `precision` int8 / int4 (`mem-read-int8`, `mem-read-int4`): the bytes of that weight-only step."""

    def __init__(self, precision: str = "fp32"):
        self.precision = precision
        self.name = "mem-read" if precision == "fp32" else f"mem-read-{precision}"

    def setup(self, ctx: Context) -> dict:
        self.cfg, self.threads, self.ctx = ctx.cfg, ctx.threads, ctx
        return {"method": "torch.sum over a float32 buffer of the decode step's bytes (weights + KV cache"
                          + ("" if self.precision == "fp32" else f"; {self.precision} weights and scales") + ")"}

    def decode(self, ids, mask, past):
        torch.set_num_threads(self.threads)
        buf = self.ctx.ones(forward_bytes(self.cfg, ids.shape[0], 1, past[0].shape[2], precision=self.precision) // 4)

        def run():
            return buf.sum()

        run.buffer = buf  # type: ignore[attr-defined]  # kept alive with the function the harness times
        return run

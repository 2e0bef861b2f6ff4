"""PyTorch eager: the reference the others are compared with."""

from __future__ import annotations

import torch

from ...model.andrea import Andrea
from .base import Backend, Context


class TorchBackend(Backend):
    """PyTorch eager, float32, inference mode, torch.set_num_threads(threads)."""

    name = "torch"

    def setup(self, ctx: Context) -> dict:
        self.model = ctx.model
        torch.set_num_threads(ctx.threads)
        return {"threads": torch.get_num_threads(), "mode": "eager, float32, torch.inference_mode"}

    def prefill(self, ids):
        x = torch.from_numpy(ids)

        def run():
            with torch.inference_mode():
                return self.model(x)

        return run

    def decode(self, ids, mask, past):
        x, m = torch.from_numpy(ids), torch.from_numpy(mask)
        pairs = [(torch.from_numpy(past[2 * i]), torch.from_numpy(past[2 * i + 1])) for i in range(len(past) // 2)]

        def run():
            with torch.inference_mode():
                return self.model.forward_with_cache(x, pairs, m)

        return run

    def generate(self, prompt, new_tokens):
        x = torch.from_numpy(prompt)

        def run():
            with torch.inference_mode():
                return torch_greedy(self.model, x, new_tokens)

        return run


def torch_greedy(model: Andrea, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy decoding with the KV cache: [B, T] prompt -> [B, new_tokens] token ids."""
    logits, past = model.forward_with_cache(prompt)
    tok = logits[:, -1].argmax(-1, keepdim=True)
    out = [tok]
    for _ in range(new_tokens - 1):
        logits, past = model.forward_with_cache(tok, past)
        tok = logits[:, -1].argmax(-1, keepdim=True)
        out.append(tok)
    return torch.cat(out, dim=1)

"""The ANDREA-120M reference model in PyTorch: a GPT-2-style pre-norm decoder, readable in one sitting.

Names follow GPT-2 (wte, wpe, h.N.ln_1, attn.c_attn, mlp.c_fc, ...) so checkpoints map over plainly.
Shapes in comments: B batch, T new tokens, P past tokens, C n_embd, H heads, D head_dim, V vocab.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..config import ModelConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)  # fused QKV
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x, past_k=None, past_v=None, key_mask=None):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B,H,T,D)
        if past_k is not None:  # KV cache: keys/values of earlier tokens, (B,H,P,D)
            k = torch.cat([past_k, k], dim=2)
            v = torch.cat([past_v, v], dim=2)
        S = k.shape[2]  # P + T
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # (B,H,T,S)
        # Causal: query i (absolute position P+i) sees keys j <= P+i. Built from positions, not a
        # stored triangle, so the same code serves any past length.
        q_pos = torch.arange(T, device=x.device)[:, None] + (S - T)
        k_pos = torch.arange(S, device=x.device)[None, :]
        allowed = k_pos <= q_pos  # (T,S)
        if key_mask is not None:  # (B,S) 1 for real tokens, 0 for padding. A padding query still sees
            # itself, so no softmax row is all -inf (its NaN would leak through 0 * NaN in att @ v).
            allowed = allowed & (key_mask[:, None, None, :].bool() | (k_pos == q_pos))
        att = att.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        return self.c_proj(y), k, v


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.gelu = nn.GELU(approximate="tanh")  # the seeds' GELU: exports as ONE ONNX Gelu(approximate="tanh")
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, past_k=None, past_v=None, key_mask=None):
        a, k, v = self.attn(self.ln_1(x), past_k, past_v, key_mask)  # pre-norm
        x = x + a
        x = x + self.mlp(self.ln_2(x))
        return x, k, v


class Andrea(nn.Module):
    """token ids (B,T) -> logits (B,T,V). The output projection is the token embedding, transposed."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.weights_source: dict = {"kind": "unknown"}  # set by checkpoint.py; recorded in artifacts
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        logits, _ = self.forward_with_cache(idx)
        return logits

    def forward_with_cache(self, idx, past=None, key_mask=None):
        """One step with a KV cache. past: list of (k, v) per layer, each (B,H,P,D), or None.
        key_mask: (B,P+T) with 0 at padded positions, or None. Returns logits and the new cache."""
        B, T = idx.shape
        P = 0 if past is None else past[0][0].shape[2]
        if key_mask is None:
            pos = torch.arange(P, P + T, device=idx.device)[None, :]
        else:  # left padding: a token's position counts only the real tokens before it
            pos = (key_mask.long().cumsum(-1) - 1).clamp(min=0)[:, P:]
        x = self.wte(idx) + self.wpe(pos)  # (B,T,C)
        present = []
        for i, block in enumerate(self.h):
            pk, pv = (None, None) if past is None else past[i]
            x, k, v = block(x, pk, pv, key_mask)
            present.append((k, v))
        x = self.ln_f(x)
        return x @ self.wte.weight.t(), present  # tied output projection, (B,T,V)

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # the tied matrix is one Parameter: counted once

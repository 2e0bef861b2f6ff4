"""A small trained ANDREA on real text, made here in about two minutes of one CPU core: the tokenizer
(text.py), then the tiny preset (ANDREA's shape: pre-norm, tanh-GELU, tied embeddings, vocab 8449)
trained from the seeded GPT-2 initialisation on the training split, with its loss curve and held-out
perplexity beside the unigram perplexity of the same text.

Reproducible to the digit: one seeded generator draws the initial weights and every batch, torch runs
deterministic algorithms on a fixed number of threads (1 by default), and nothing else is random. The
same code, corpus, torch and recipe give bit-identical weights and perplexity on the same machine.
Another CPU rounds differently and trains other weights (held-out perplexity 343.8, 301.2 and 294.6 on
three CPUs of one machine kind), so the repository ships one training, models/andrea-tiny-demo, which
the tests and the README's examples use; `train.json` records what made it.
The main path (`andrea-export build`) never needs it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import time
from pathlib import Path

import numpy as np
import torch

from ..config import ANDREA_TINY, ModelConfig
from ..folder.atomic import write_text_atomic
from ..progress import step as timed_step
from . import text

FILES = {"tokenizer": "tokenizer.json", "checkpoint": "model.safetensors", "heldout": "heldout.txt",
         "log": "train.json", "plot": "loss.png"}


@dataclasses.dataclass(frozen=True)
class Recipe:
    config: ModelConfig = ANDREA_TINY
    seed: int = 0
    steps: int = 600  # about 2 minutes of one core (measured: 128 s CPU with the tokenizer, 7.5 s of it)
    batch: int = 8  # windows of config.n_positions + 1 tokens at seeded random offsets; measured: more,
    # smaller steps learn more per CPU second here than batch 16 (held-out 518 vs 610 after 300k tokens)
    lr: float = 8e-3  # AdamW peak; linear warm-up, then cosine decay to lr/10
    warmup: int = 30
    weight_decay: float = 0.01
    eval_every: int = 50  # held-out perplexity for the curve
    threads: int = 1

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "config": self.config.to_dict()}


@contextlib.contextmanager
def _deterministic(threads: int):
    prev_threads, prev_det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(prev_threads)
        torch.use_deterministic_algorithms(prev_det)


def model_perplexity(model, wins: np.ndarray) -> float:
    with torch.inference_mode():
        return text.perplexity(lambda ids: model(torch.from_numpy(ids)).numpy(), wins)


def train_demo(out: str | Path, recipe: Recipe = Recipe(), quiet: bool = False) -> dict:
    """Train the tokenizer and the model into `out` (tokenizer.json, model.safetensors, heldout.txt,
    train.json, loss.png); returns the log (also train.json)."""
    from .checkpoint import random_init, save_checkpoint

    out = Path(out)
    t_wall, t_cpu = time.perf_counter(), time.process_time()
    with timed_step("Collecting the corpus (the interpreter's documentation and docstrings)", quiet=quiet):
        train_docs, held_docs = text.corpus()
    with timed_step("Training the BPE tokenizer and encoding the text", quiet=quiet):
        tok = text.train_tokenizer(train_docs)
        train_ids = text.encode(tok, text.join(train_docs))
        held_text = text.join(held_docs)
        cfg = recipe.config
        wins = text.windows(text.encode(tok, held_text), cfg.n_positions)
    stream = torch.tensor(train_ids, dtype=torch.long)
    t_tok = time.process_time() - t_cpu

    model, losses, curve = train_model(stream, wins, recipe, quiet=quiet)
    with _deterministic(recipe.threads):
        ppl = model_perplexity(model, wins)
    log = {
        "recipe": recipe.to_dict(), "corpus": text.corpus_info(train_docs, held_docs),
        "tokenizer": {"vocab_size": tok.get_vocab_size(), "sha256": hashlib.sha256(tok.to_str().encode()).hexdigest()},
        "train_tokens": len(train_ids), "heldout_tokens": int(wins.size), "heldout_windows": int(wins.shape[0]),
        "tokens_seen": recipe.steps * recipe.batch * cfg.n_positions,
        "heldout_perplexity": ppl, "unigram_perplexity": text.unigram_perplexity(train_ids, wins),
        "initial_heldout_perplexity": model_perplexity(random_init(cfg, seed=recipe.seed, announce=False), wins),
        "loss": losses, "curve": curve,
        "cpu_seconds": round(time.process_time() - t_cpu, 1), "tokenizer_cpu_seconds": round(t_tok, 1),
        "wall_seconds": round(time.perf_counter() - t_wall, 1), "versions": _versions(),
    }
    out.mkdir(parents=True, exist_ok=True)
    text.save_tokenizer(tok, out / FILES["tokenizer"])
    write_text_atomic(out / FILES["heldout"], held_text)
    save_checkpoint(model, out / FILES["checkpoint"])
    plot_loss(log, out / FILES["plot"])
    write_text_atomic(out / FILES["log"], text.dumps(log))
    return log


def train_model(stream: torch.Tensor, wins: np.ndarray, recipe: Recipe, quiet: bool = True):
    """Train the model from its seeded initialisation on random windows of the token `stream`; returns
    (model in eval mode, loss per step, held-out perplexity every recipe.eval_every steps)."""
    from ..progress import console
    from .checkpoint import random_init

    cfg, T = recipe.config, recipe.config.n_positions
    losses, curve = [], []
    with _deterministic(recipe.threads):
        model = random_init(cfg, seed=recipe.seed, announce=False).train()
        gen = torch.Generator().manual_seed(recipe.seed + 1)
        decay = [p for p in model.parameters() if p.dim() == 2]  # matrices and embeddings; not LN or biases
        other = [p for p in model.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                                 {"params": other, "weight_decay": 0.0}], lr=recipe.lr, betas=(0.9, 0.95))
        for step in range(recipe.steps):
            for g in opt.param_groups:
                g["lr"] = _lr(step, recipe)
            starts = torch.randint(0, len(stream) - T - 1, (recipe.batch,), generator=gen)
            chunk = torch.stack([stream[s:s + T + 1] for s in starts.tolist()])
            logits = model(chunk[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), chunk[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
            if (step + 1) % recipe.eval_every == 0 or step + 1 == recipe.steps:
                model.eval()
                curve.append({"step": step + 1, "heldout_perplexity": model_perplexity(model, wins)})
                model.train()
                if not quiet:
                    console.print(f"  step {step + 1}/{recipe.steps}: train loss {np.mean(losses[-recipe.eval_every:]):.3f}, "
                                  f"held-out perplexity {curve[-1]['heldout_perplexity']:.2f}")
    return model.eval(), losses, curve


def _lr(step: int, r: Recipe) -> float:
    if step < r.warmup:
        return r.lr * (step + 1) / r.warmup
    t = (step - r.warmup) / max(1, r.steps - r.warmup)
    return r.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def plot_loss(log: dict, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..folder.atomic import atomic_path

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    loss = np.asarray(log["loss"])
    ax.plot(np.arange(1, len(loss) + 1), loss, lw=0.6, alpha=0.5, label="training loss (per batch)")
    steps = [c["step"] for c in log["curve"]]
    ax.plot(steps, [math.log(c["heldout_perplexity"]) for c in log["curve"]], "o-", ms=3, label="held-out loss")
    ax.axhline(math.log(log["unigram_perplexity"]), ls="--", c="gray", lw=0.8, label="unigram (held-out)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    r = log["recipe"]
    ax.set_title(f"{r['config']['name']} on Python's docs: held-out perplexity {log['heldout_perplexity']:.1f} "
                 f"(unigram {log['unigram_perplexity']:.0f})", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", metadata={"Software": None})
    plt.close(fig)
    return Path(path)


def _versions() -> dict:
    import importlib.metadata as md

    return {d: md.version(d) for d in ("torch", "tokenizers", "numpy")}

"""Real text without a download: the English documentation every Python interpreter ships
(`pydoc_data.topics`, about 465 KB, and the docstrings of the standard library, 1.3 MB), a byte-level
BPE tokenizer with ANDREA's 8449 tokens trained on it (Hugging Face `tokenizers`), and perplexity of
token windows.

Every tenth block of the topics is held out (never seen by the tokenizer's or the model's training).
The text differs between Python versions, so its sha256 and the version are recorded wherever it is
used (`corpus_info`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import platform
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .. import userfiles
from ..errors import ConfigError, require
from ..folder.atomic import write_bytes_atomic, write_text_atomic
from ..names import EOT  # separates documents; id 0

VOCAB_SIZE = 8449  # ANDREA's
HELDOUT_EVERY = 10  # block i of the topics is held out when i % 10 == 9
BLOCK_CHARS = 2000


@functools.cache  # 4 s of parsing; the same on every call in a process (demo.cache_key, then train_demo)
def corpus() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(training documents, held-out documents). The pydoc topics, sorted by name, as paragraphs
    (reflowed; a paragraph that appears again, as whole sections of the topics do, is kept once, so no
    held-out text is also training text), joined into blocks of at least BLOCK_CHARS: every tenth block is held
    out, the rest is training text, and so are the longer docstrings of the standard library's
    modules (files in sorted order)."""
    from pydoc_data.topics import topics

    seen: set[str] = set()
    blocks: list[str] = []
    for key in sorted(topics):
        cur = ""
        for para in map(reflow, topics[key].strip().split("\n\n")):
            if para.strip() in seen:
                continue
            seen.add(para.strip())
            cur = f"{cur}\n\n{para}" if cur else para
            if len(cur) >= BLOCK_CHARS:
                blocks.append(cur)
                cur = ""
        if cur:
            blocks.append(cur)
    held = [b for i, b in enumerate(blocks) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
    train = [b for i, b in enumerate(blocks) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1]
    return tuple(train + stdlib_docstrings()), tuple(held)


def stdlib_docstrings(min_chars: int = 200) -> list[str]:
    """Docstrings (module, class, function) of at least `min_chars` from the standard library's .py
    files, tests left out; read with `ast` (nothing is imported or run), files in sorted order."""
    import ast
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idle_test", "site-packages", "dist-packages"}
    docs = []
    for f in sorted(root.rglob("*.py")):
        parts = f.relative_to(root).parts
        if any(p in skip or p.startswith("test_") for p in parts):
            continue
        try:
            tree = ast.parse(f.read_bytes())
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                d = ast.get_docstring(node)
                if d and len(d) >= min_chars:
                    docs.append("\n\n".join(map(reflow, d.split("\n\n"))))
    return docs


def reflow(para: str) -> str:
    """One line for a paragraph of prose hard-wrapped at 70 columns (every line at the same indent, or
    a list item whose later lines hang under its text; no heading underline, no doctest): the line
    breaks are layout, and a small model otherwise learns mostly where lines end (measured: "\n" was
    8 % of the tokens, and greedy decoding produced nothing else). Code and other layout stay."""
    lines = para.split("\n")
    if len(lines) < 2 or not all(line.strip() for line in lines):
        return para
    indent = [len(line) - len(line.lstrip()) for line in lines]
    stripped = [line.strip() for line in lines]
    bullet = re.match(r"\s*(?:[*+-]|\d+\.|\[\d+\]) ", lines[0])
    if len(set(indent)) != 1 and not (bullet and set(indent[1:]) == {bullet.end()}):
        return para
    if any(t.startswith((">>>", "...")) or len(set(t)) == 1 for t in stripped):
        return para
    return " " * indent[0] + " ".join(stripped)


def join(docs: Sequence[str]) -> str:
    return f"\n{EOT}\n".join(docs)


def corpus_info(train_docs: Sequence[str] | None = None, held_docs: Sequence[str] | None = None) -> dict:
    """What the corpus is on this interpreter: Python version, sizes and sha256 of both splits."""
    if train_docs is None or held_docs is None:
        train_docs, held_docs = corpus()
    train, held = join(train_docs), join(held_docs)
    return {"source": "pydoc_data.topics + stdlib docstrings", "python": platform.python_version(),
            "heldout_every": HELDOUT_EVERY, "train_chars": len(train), "heldout_chars": len(held),
            "train_sha256": hashlib.sha256(train.encode()).hexdigest(),
            "heldout_sha256": hashlib.sha256(held.encode()).hexdigest()}


def train_tokenizer(docs: Sequence[str], vocab_size: int = VOCAB_SIZE):
    """A GPT-2-style byte-level BPE with exactly `vocab_size` tokens ({EOT} is id 0). Deterministic:
    the same documents give the same tokenizer.json bytes (a test trains twice)."""
    tk = require("tokenizers", "text", "Training the tokenizer")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT],
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer=trainer)
    if tok.get_vocab_size() != vocab_size:  # the text ran out of pairs seen twice
        raise ConfigError(f"the corpus gave a tokenizer of {tok.get_vocab_size()} tokens, not {vocab_size}")
    return tok


# A chat template for a model that was never taught to chat: each message's text on its own lines, nothing the
# model would not know (Hugging Face's Jinja format), so chat clients work with a plain continuation.
PLAIN_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}\n{% endfor %}"


def tokenizer_config(n_positions: int) -> dict:
    """The `tokenizer_config.json` beside a tokenizer.json of ours: a GPT-2 byte-level BPE with EOT as its
    special token, which transformers' AutoTokenizer and onnxruntime-genai's `og.Tokenizer` need to load it
    (both encode as `tokenizers` does: tested), and the plain chat template `serve`'s chat route renders."""
    return {"tokenizer_class": "GPT2Tokenizer", "bos_token": EOT, "eos_token": EOT, "unk_token": EOT,
            "add_prefix_space": False, "model_max_length": n_positions, "chat_template": PLAIN_CHAT_TEMPLATE}


def write_tokenizer_files(tokenizer: str | Path, folder: str | Path, n_positions: int) -> list[str]:
    """tokenizer.json (checked, then copied) and its tokenizer_config.json into `folder`; their names."""
    import json

    from ..names import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE

    data = userfiles.read_bytes(tokenizer, userfiles.MAX_TOKENIZER_BYTES, "a tokenizer.json", ConfigError)
    _parse_tokenizer(userfiles.decode(data, str(tokenizer), "a tokenizer.json", ConfigError), tokenizer)  # first
    write_bytes_atomic(Path(folder) / TOKENIZER_FILE, data)  # the bytes that were checked, read once
    write_text_atomic(Path(folder) / TOKENIZER_CONFIG_FILE, json.dumps(tokenizer_config(n_positions), indent=2) + "\n")
    return [TOKENIZER_FILE, TOKENIZER_CONFIG_FILE]


def save_tokenizer(tok, path: str | Path) -> Path:
    return write_text_atomic(path, tok.to_str())


def load_tokenizer(path: str | Path):
    """A tokenizer.json (plain JSON: nothing is executed), with a clear error for anything else."""
    return _parse_tokenizer(userfiles.read_text(path, userfiles.MAX_TOKENIZER_BYTES, "a tokenizer.json", ConfigError), path)


def _parse_tokenizer(text: str, path: str | Path):
    tk = require("tokenizers", "text", "A tokenizer")
    try:
        return tk.Tokenizer.from_str(text)
    except Exception as e:  # the Rust side raises a bare Exception
        raise ConfigError(f"{path}: not a readable tokenizer.json ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None


def read_text(path: str | Path) -> str:
    """An evaluation text: UTF-8, a regular file of bounded size."""
    return userfiles.read_text(path, userfiles.MAX_TEXT_BYTES, "an evaluation text", ConfigError)


def encode(tok, text: str) -> list[int]:
    return tok.encode(text).ids


def windows(ids: list[int], length: int) -> np.ndarray:
    """Non-overlapping windows of `length` tokens ([n, length] int64); the tail shorter than a window is
    dropped, so every window is scored the same way (each position predicts the next, within its window)."""
    n = len(ids) // length
    if n == 0:
        raise ConfigError(f"the evaluation text has {len(ids)} tokens, fewer than one window of {length}")
    return np.asarray(ids[: n * length], dtype=np.int64).reshape(n, length)


def nll_sum(logits: np.ndarray, ids: np.ndarray) -> float:
    """Summed negative log-likelihood (nats, float64) of ids[:, 1:] under logits[:, :-1]."""
    x = logits[:, :-1].astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    logz = np.log(np.exp(x).sum(-1))
    picked = np.take_along_axis(x, ids[:, 1:, None], axis=-1)[..., 0]
    return float((logz - picked).sum())


def perplexity(forward, wins: np.ndarray, batch: int = 16) -> float:
    """exp(mean NLL) of every next token within the windows; `forward` maps [b, T] int64 ids to logits."""
    total = sum(nll_sum(np.asarray(forward(wins[i:i + batch])), wins[i:i + batch]) for i in range(0, len(wins), batch))
    return float(np.exp(total / (wins.shape[0] * (wins.shape[1] - 1))))


def unigram_perplexity(train_ids: list[int], eval_ids: np.ndarray, vocab_size: int = VOCAB_SIZE) -> float:
    """The perplexity of a model that knows only token frequencies (from the training text, add-one
    smoothed), on the same predicted tokens `perplexity` scores: the bar a trained model must clear."""
    counts = np.bincount(np.asarray(train_ids), minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(np.exp(-logp[eval_ids[:, 1:]].mean()))


def describe_text(text: str, tok, tokens: int) -> dict:
    """What an evaluation text is; `tokens`: how many `tok` makes of it (the caller has encoded it)."""
    return {"sha256": hashlib.sha256(text.encode()).hexdigest(), "chars": len(text), "tokens": tokens,
            "tokenizer_sha256": hashlib.sha256(tok.to_str().encode()).hexdigest()}


def dumps(obj) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"

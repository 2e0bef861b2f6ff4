"""The peer most CPU users run (`llama-cpp`, `llama-cpp-q8_0`, `llama-cpp-q4_0`): llama.cpp through
llama-cpp-python, on the same weights written as an f32 GGUF (deploy/gguf.py) and, for the two block formats,
quantized by llama.cpp's own quantizer with llama-quantize's defaults (Q4_0 keeps the tied embedding / output at
Q6_K, or Q8_0 where its rows are not a multiple of 256, as andrea-tiny's). f32 KV cache, flash attention off (llama-cpp-python's default; on a 2-core AMD EPYC "auto" turned it on
and ran 1.6x slower), `threads` threads.

Every scenario goes through llama.cpp's batch API (`llama_decode` on a `llama_batch`, each row its own
sequence, as llama.cpp's batched examples run): prefill is one decode of every row's prompt with the logits of
every token; generate is greedy, exactly `new_tokens` tokens a row, one decode a step for all rows. Decode
alone has no call (llama.cpp owns its cache); its steps are inside generate. llama-cpp-python compiles
llama.cpp from source (`pip install llama-cpp-python`: about 12 minutes on 2 cores), so no extra installs it.
"""

from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path

import numpy as np

from .base import Backend, Unavailable

KINDS = {"f32": ("fp32", None), "q8_0": ("int8", 7), "q4_0": ("int4", 2)}  # -> (precision, llama_ftype)


class LlamaCppBackend(Backend):
    def __init__(self, kind: str = "f32"):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, not {kind!r}")
        self.kind, (self.precision, self.ftype) = kind, KINDS[kind]
        self.name = "llama-cpp" if kind == "f32" else f"llama-cpp-{kind}"
        self.contexts: dict[tuple[int, int], tuple] = {}

    def check(self):
        for module, why in (("llama_cpp", "pip install llama-cpp-python (compiles llama.cpp: about 12 minutes on 2 "
                                          "cores)"), ("gguf", "pip install 'andrea-export[gguf]'")):
            if importlib.util.find_spec(module) is None:
                return f"'{module}' is not installed ({why})"
        return None

    def setup(self, ctx):
        self.ctx = ctx
        import llama_cpp

        return {"threads": ctx.threads, "device": "cpu", "version": llama_cpp.__version__,
                "file": f"GGUF {self.kind} ({'andrea-export package --gguf' if self.kind == 'f32' else 'llama.cpp quantizer'})",
                "compute_precision": self.precision}  # fmt: skip

    def prepare(self, scenarios):
        import llama_cpp

        from ...deploy.gguf import write_gguf_of_graph

        llama_cpp.llama_backend_init()
        version = llama_cpp.__version__
        f32 = self.ctx.cached("llama-cpp.f32.gguf",
                              lambda p: write_gguf_of_graph(self.ctx.prefill_onnx(), self.ctx.cfg, p, "f32"))
        self.path = f32 if self.ftype is None else self.ctx.cached(f"llama-cpp{version}.{self.kind}.gguf",
                                                                   self._quantize(f32))
        self.model = llama_cpp.llama_model_load_from_file(str(self.path).encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise Unavailable(f"llama.cpp could not load {self.path}")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))

    def _quantize(self, f32: Path):
        def make(out: Path) -> None:
            import llama_cpp

            from ...folder.atomic import atomic_path

            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype, params.nthread = self.ftype, self.ctx.threads
            with atomic_path(out) as tmp:
                if llama_cpp.llama_model_quantize(str(f32).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
                    raise Unavailable(f"llama.cpp's quantizer could not write {self.kind} from {f32}")

        return make

    def _context(self, rows: int, tokens: int):
        """A context for `rows` sequences of up to `tokens` each, and its batch (made once per shape)."""
        import llama_cpp

        if (rows, tokens) not in self.contexts:
            cp = llama_cpp.llama_context_default_params()
            cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = rows * tokens, rows * tokens, 512, rows
            cp.n_threads = cp.n_threads_batch = self.ctx.threads
            cp.type_k = cp.type_v = 0  # GGML_TYPE_F32
            cp.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
            context = llama_cpp.llama_init_from_model(self.model, cp)
            if not context:
                raise Unavailable(f"llama.cpp could not make a context of {rows} x {tokens} tokens")
            self.contexts[rows, tokens] = (context, llama_cpp.llama_batch_init(rows * tokens, 0, rows))
        return self.contexts[rows, tokens]

    def _decode(self, context, batch, items) -> None:  # items: (token, position, row, logits wanted)
        import llama_cpp

        batch.n_tokens = len(items)
        for i, (t, p, s, want) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, p, 1, want
            batch.seq_id[i][0] = s
        if llama_cpp.llama_decode(context, batch) != 0:
            raise Unavailable("llama_decode failed")

    def prefill(self, ids):
        import llama_cpp

        rows, length = ids.shape
        context, batch = self._context(rows, length)
        items = [(int(t), j, s, True) for s, row in enumerate(ids.tolist()) for j, t in enumerate(row)]

        def run():
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(context), True)
            self._decode(context, batch, items)
            return np.ctypeslib.as_array(llama_cpp.llama_get_logits(context), shape=(rows * length, self.n_vocab))

        return run

    def decode(self, ids, mask, past):
        raise Unavailable("llama.cpp owns its cache (no call for one step on a given past); its decode steps are timed "
                          "inside generate")

    def generate(self, prompt, new_tokens):
        """Greedy, exactly `new_tokens` tokens: [B, new_tokens] token ids."""
        import llama_cpp

        rows, length = prompt.shape
        context, batch = self._context(rows, length + new_tokens)
        first = [(int(t), j, s, j == length - 1) for s, row in enumerate(prompt.tolist()) for j, t in enumerate(row)]

        def run():
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(context), True)
            self._decode(context, batch, first)
            where, out = [(s + 1) * length - 1 for s in range(rows)], np.empty((rows, new_tokens), dtype=np.int64)
            for step in range(new_tokens):
                for s, i in enumerate(where):
                    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(context, i), shape=(self.n_vocab,))
                    out[s, step] = int(np.argmax(logits))
                if step < new_tokens - 1:
                    self._decode(context, batch, [(int(out[s, step]), length + step, s, True) for s in range(rows)])
                    where = list(range(rows))
            return out

        return run

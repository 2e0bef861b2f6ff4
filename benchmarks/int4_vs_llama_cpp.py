#!/usr/bin/env python
"""Our weight-only int4 / int8 against llama.cpp's Q4_0 / Q8_0 on the same weights: fidelity to our fp32, the
bytes each reads per decode step, and batch-1 decode speed, in one run on one machine.

    python benchmarks/int4_vs_llama_cpp.py out/andrea-120m-fp32            # a float32 build folder
    python benchmarks/int4_vs_llama_cpp.py BUILD --prompts 64 --new 64 --out benchmarks/results/int4-vs-llama-cpp.md

Ours: the build's in-place decoder (fp32) quantized as `build --precision int4|int8` quantizes it
(graphs/quantize.py: int4's weights solved by GPTQ, the head width measured by choose_head_bits), run by our
runtime on ONNX Runtime. llama.cpp's:
the build written as an f32 GGUF (`package --gguf`), quantized by llama.cpp's own quantizer (llama-quantize's
defaults: Q4_0 keeps the tied embedding / output at Q6_K), run by llama-cpp-python with its f32 KV cache. Both
on the same random prompts, and so is our own q4_0 GGUF (`package --gguf --gguf-type q4_0`: its linear layers
GPTQ-solved, the token embedding q8_0). Fidelity is against our fp32 decoder: the first next token's logits
(largest difference, top-1 kept, mean KL) and greedy tokens position by position. Needs llama-cpp-python, which compiles
llama.cpp from source (`pip install llama-cpp-python`: about 12 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LLAMA_FTYPE = {"Q4_0": 2, "Q8_0": 7}  # llama_ftype: LLAMA_FTYPE_MOSTLY_Q4_0, _Q8_0


def ours(build: Path, tmp: Path, precision: str) -> Path:
    """The build's fp32 in-place decoder quantized as a `build --precision` would."""
    from andrea_export.graphs.quantize import choose_int4, quantize_weights

    int4 = choose_int4(build / "model.onnx") if precision == "int4" else None
    return quantize_weights(build / "decoder.inplace.onnx", tmp / precision / "decoder.inplace.onnx", precision,
                            *((int4.head_bits, int4.solved) if int4 else (None, None)))


def llama_file(build: Path, tmp: Path, kind: str) -> Path:
    import llama_cpp

    from andrea_export.deploy.gguf import write_gguf

    f32 = tmp / "f32.gguf"
    if not f32.exists():
        write_gguf(build, f32, "f32")
    out = tmp / f"{kind}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = LLAMA_FTYPE[kind], 2
    if llama_cpp.llama_model_quantize(str(f32).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama.cpp could not quantize {f32} to {kind}")
    return out


class Ours:
    def __init__(self, path: Path, threads: int):
        from andrea_export import runtime

        self.session = runtime.load(path, "onnxruntime", intra_op_threads=threads)

    def first(self, prompt: list[int]) -> np.ndarray:
        return self.session.forward(prompt)[-1]

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        return self.session.generate(prompt, n, ignore_eos=True)


class Llama:
    def __init__(self, path: Path, threads: int, context: int):
        import llama_cpp

        self.path = path
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                                   logits_all=True, verbose=False, type_k=0, type_v=0)  # type 0: an f32 KV cache

    def first(self, prompt: list[int]) -> np.ndarray:
        self.llm.reset()
        self.llm.eval(prompt)
        return np.array(self.llm.scores[self.llm.n_tokens - 1], dtype=np.float32)

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        self.first(prompt)
        out = []
        while True:
            out.append(int(np.argmax(self.llm.scores[self.llm.n_tokens - 1])))
            if len(out) == n:
                return out
            self.llm.eval([out[-1]])


class LlamaBatched:
    """Greedy decoding of several sequences, one llama_decode a step for all of them (llama.cpp's batch API, as its
    own batched examples drive it), for the speed at batch B: f32 KV cache, flash attention off (llama-cpp-python's
    default; on this CPU "auto" turned it on and ran 1.6x slower)."""

    def __init__(self, path: Path, threads: int, context: int, batch: int):
        import llama_cpp

        self.api = llama_cpp
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = context * batch, context * batch, 512, batch
        cp.n_threads = cp.n_threads_batch = threads
        cp.type_k = cp.type_v = 0  # GGML_TYPE_F32
        cp.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.ctx = llama_cpp.llama_init_from_model(self.model, cp)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(context * batch, 0, batch)

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:  # (token, position, sequence, logits?)
        b = self.batch
        b.n_tokens = len(items)
        for i, (t, p, s, want) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, p, 1, want
            b.seq_id[i][0] = s
        if self.api.llama_decode(self.ctx, b) != 0:
            raise SystemExit("llama_decode failed")

    def generate(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        api = self.api
        api.llama_memory_clear(api.llama_get_memory(self.ctx), True)
        length = len(prompts[0])
        self._decode([(t, j, s, j == length - 1) for s, p in enumerate(prompts) for j, t in enumerate(p)])
        rows, out = [(s + 1) * length - 1 for s in range(len(prompts))], [[] for _ in prompts]
        for step in range(n):
            tokens = [int(np.argmax(np.ctypeslib.as_array(api.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))))
                      for i in rows]
            for o, t in zip(out, tokens):
                o.append(t)
            if step < n - 1:
                self._decode([(t, length + step, s, True) for s, t in enumerate(tokens)])
                rows = list(range(len(prompts)))
        return out


def fidelity(ref: dict, got: dict) -> dict:
    a, b = ref["first"], got["first"]
    la, lb = a - a.max(-1, keepdims=True), b - b.max(-1, keepdims=True)
    la, lb = la - np.log(np.exp(la).sum(-1, keepdims=True)), lb - np.log(np.exp(lb).sum(-1, keepdims=True))
    same = sum(x == y for r, g in zip(ref["greedy"], got["greedy"]) for x, y in zip(r, g))
    return {"max_abs_diff": float(np.abs(a - b).max()), "top1": int((a.argmax(-1) == b.argmax(-1)).sum()),
            "kl": float((np.exp(la) * (la - lb)).sum(-1).mean()), "greedy_same": int(same)}


def generate_rate(generate, prompts: list[list[int]], n: int) -> float:
    """Tokens a second of one greedy generation of `n` tokens for every prompt at once (the prefill included)."""
    t0 = time.perf_counter()
    generate(prompts, n)
    return len(prompts) * n / (time.perf_counter() - t0)


def ours_bytes(path: Path) -> int:
    """Weights a decode step reads: every initializer but the tables only gathered from (one row each; fp32's
    token embedding is also its head, read whole)."""
    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(path))
    readers: dict[str, set[str]] = {}
    for n in m.graph.node:
        for i in n.input:
            readers.setdefault(i, set()).add(n.op_type)
    return sum(numpy_helper.to_array(t).nbytes for t in m.graph.initializer if readers.get(t.name) != {"Gather"})


def gguf_bytes(path: Path) -> int:
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors if t.name != "position_embd.weight")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("build", type=Path, help="a float32 build folder (model.onnx, decoder.inplace.onnx)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new", type=int, default=64, help="greedy tokens per prompt for the agreement")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--speed-tokens", type=int, default=128, help="tokens generated per prompt for the speed")
    ap.add_argument("--rounds", type=int, default=3, help="speed rounds, interleaved across runners (best of)")
    ap.add_argument("--out", type=Path, default=None, help="also write the table (markdown) and a .json beside it")
    args = ap.parse_args()
    from andrea_export.bench.machine import environment, measure_machine
    from andrea_export.deploy.gguf import write_gguf

    from andrea_export.graphs.layout import read_config

    cfg = read_config(args.build / "model.onnx")
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, cfg.vocab_size, (args.prompts, args.prompt_len)).tolist()
    context = args.prompt_len + max(args.new, args.speed_tokens) + 8
    with tempfile.TemporaryDirectory(prefix="int4-vs-llama-") as t:
        tmp = Path(t)
        runners = {"ours fp32": (Ours(args.build / "decoder.inplace.onnx", args.threads), ours_bytes(args.build / "decoder.inplace.onnx"))}
        for p in ("int8", "int4"):
            path = ours(args.build, tmp, p)
            runners[f"ours {p}"] = (Ours(path, args.threads), ours_bytes(path))
        for kind in ("Q8_0", "Q4_0"):
            path = llama_file(args.build, tmp, kind)
            runners[f"llama.cpp {kind}"] = (Llama(path, args.threads, context), gguf_bytes(path))
        path = write_gguf(args.build, tmp / "ours-q4_0.gguf", "q4_0")  # GPTQ-solved Q4_0 blocks (deploy/gguf.py)
        runners["llama.cpp, our q4_0 GGUF"] = (Llama(path, args.threads, context), gguf_bytes(path))
        results = {name: {"first": np.stack([r.first(p) for p in prompts]), "greedy": [r.greedy(p, args.new) for p in prompts]}
                   for name, (r, _) in runners.items()}
        generators = {}  # (runner, batch) -> generate(prompts, n)
        for name, (r, _) in runners.items():
            for b in (1, 8):
                generators[name, b] = ((lambda ps, n, r=r: r.session.generate(ps, n, ignore_eos=True)) if isinstance(r, Ours)
                                       else LlamaBatched(r.path, args.threads, args.prompt_len + args.speed_tokens, b).generate)
        speed = {key: 0.0 for key in generators}
        for _ in range(args.rounds):  # interleaved: drift on a shared machine hits every runner alike
            for (name, b), generate in generators.items():
                speed[name, b] = max(speed[name, b], generate_rate(generate, prompts[:b], args.speed_tokens))
    machine = measure_machine(args.threads, quick=True)
    rows = []
    for name, (_, nbytes) in runners.items():
        f = fidelity(results["ours fp32"], results[name])
        floor = machine["bandwidth_GBps"] * 1e9 / nbytes  # steps a second if only the weights were read
        rows.append({"runner": name, "MB_per_step": nbytes / 1e6, **f, "generate_tok_s_b1": speed[name, 1],
                     "generate_tok_s_b8": speed[name, 8], "bandwidth_floor_tok_s": floor})
    n, g, cpu = args.prompts, args.prompts * args.new, environment()["cpu"]
    lines = [f"{args.prompts} random {args.prompt_len}-token prompts, {args.new} greedy tokens each, against ours fp32; "
             f"generate: batch 1 and 8, {args.prompt_len}-token prompts + {args.speed_tokens} tokens (the prefill "
             f"included), best of {args.rounds} interleaved rounds, {args.threads} "
             f"threads. Machine: {cpu['model']}, {cpu['usable_cores']} cores ({', '.join(cpu['isa'])}); bandwidth "
             f"{machine['bandwidth_GBps']:.1f} GB/s ({machine['method']}): the last column is the batch-1 decode rate if "
             "a step only read its weights at that rate.", "",
             "| runner | MB read / step | first token max abs diff | top-1 kept | mean KL | greedy same | generate tok/s "
             "B1 | B8 | at the bandwidth (B1) |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['runner']} | {r['MB_per_step']:.1f} | {r['max_abs_diff']:.3f} | {r['top1']}/{n} | "
                     f"{r['kl']:.4f} | {r['greedy_same']}/{g} | {r['generate_tok_s_b1']:.0f} | {r['generate_tok_s_b8']:.0f} | "
                     f"{r['bandwidth_floor_tok_s']:.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text, encoding="utf-8")
        args.out.with_suffix(".json").write_text(json.dumps({"rows": rows, "machine": machine, "args": {
            k: str(v) for k, v in vars(args).items()}}, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()

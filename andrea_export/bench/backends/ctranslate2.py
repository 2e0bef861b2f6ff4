"""The peer CTranslate2 users run (`ctranslate2`, `ctranslate2-int8`): its Transformers converter on
transformers' GPT-2 holding the same weights (float32, or int8 weights), run by `ctranslate2.Generator` on
the CPU with `threads` intra-op threads. (CTranslate2 4.8 has no bf16 compute on a CPU: it refuses it.)

The converter needs a tokenizer for the vocabulary; ANDREA's ids are given as tokens named "<id>" (a
word-level tokenizer written beside the weights), so CTranslate2 sees exactly our ids. Prefill:
`Generator.forward_batch` (logits of every prompt token); generate: `generate_batch`, greedy
(`sampling_topk=1`), exactly `new_tokens` tokens, no end token. Decode alone has no call (the generator owns
its cache); its steps are inside generate.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import tempfile
from pathlib import Path

from .base import Backend, Unavailable

QUANTIZATIONS = {"float32": "fp32", "int8": "int8"}


def token(i: int) -> str:
    return f"<{i}>"


def convert_with_ctranslate2(model, out: str | Path, quantization: str) -> Path:
    """`out/` with CTranslate2's conversion of `model` (through transformers' GPT-2), model.bin last."""
    import ctranslate2
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from ...deploy.optimum import to_transformers
    from ...folder.atomic import staging

    out = Path(out)
    with tempfile.TemporaryDirectory(prefix="andrea-hf-") as hf_dir, staging(out, marker_suffix=".bin") as tmp:
        to_transformers(model).save_pretrained(hf_dir)
        vocab = Tokenizer(models.WordLevel({token(i): i for i in range(model.cfg.vocab_size)}, unk_token=token(0)))
        PreTrainedTokenizerFast(tokenizer_object=vocab, bos_token=token(0), eos_token=token(0),
                                unk_token=token(0)).save_pretrained(hf_dir)  # fmt: skip
        ctranslate2.converters.TransformersConverter(hf_dir).convert(str(tmp), quantization=quantization, force=True)
    return out


class Ct2Backend(Backend):
    def __init__(self, quantization: str = "float32"):
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, not {quantization!r}")
        self.quantization = quantization
        self.precision = QUANTIZATIONS[quantization]
        self.name = "ctranslate2" if quantization == "float32" else f"ctranslate2-{quantization}"

    def check(self):
        for module in ("ctranslate2", "transformers", "tokenizers"):
            if importlib.util.find_spec(module) is None:
                return f"'{module}' is not installed (pip install 'andrea-export[peers]': ctranslate2)"
        return None

    def setup(self, ctx):
        self.ctx = ctx
        return {"threads": ctx.threads, "inter_threads": 1, "device": "cpu",
                "version": importlib.metadata.version("ctranslate2"),
                "converter": f"ctranslate2 TransformersConverter, quantization {self.quantization}"}  # fmt: skip

    def prepare(self, scenarios):
        import ctranslate2

        version = importlib.metadata.version("ctranslate2")
        try:
            folder = self.ctx.cached(f"ctranslate2{version}-{self.quantization}/model.bin",
                                     lambda p: convert_with_ctranslate2(self.ctx.model, p.parent, self.quantization)).parent  # fmt: skip
            self.gen = ctranslate2.Generator(str(folder), device="cpu", compute_type=self.quantization,
                                             intra_threads=self.ctx.threads, inter_threads=1)  # fmt: skip
        except Exception as e:  # a third-party converter's error (any type) fails this peer, not the whole run
            raise Unavailable(f"CTranslate2's conversion or load failed: {type(e).__name__}: {e}") from e
        self.compute_precision = self.gen.compute_type  # e.g. int8_float32: int8 weights, fp32 activations

    def prefill(self, ids):
        tokens = [[token(i) for i in row] for row in ids.tolist()]
        return lambda: self.gen.forward_batch(tokens)

    def decode(self, ids, mask, past):
        raise Unavailable("CTranslate2's generator owns its cache (no call for one step on a given past); its decode "
                          "steps are timed inside generate")  # fmt: skip

    def generate(self, prompt, new_tokens):
        """Greedy, exactly `new_tokens` tokens: [B, new_tokens] token ids."""
        import numpy as np

        tokens = [[token(i) for i in row] for row in prompt.tolist()]

        def run():
            out = self.gen.generate_batch(tokens, max_length=new_tokens, min_length=new_tokens, sampling_topk=1,
                                          include_prompt_in_result=False, end_token=[])  # fmt: skip
            return np.array([r.sequences_ids[0] for r in out])

        return run

"""The peer that runs our build folder as it is: onnxruntime-genai (`og.Model(folder)`), reading the
`genai_config.json` the build writes (`andrea_export/deploy/genai.py`), which points genai at the in-place
decoder `decoder.inplace.onnx` (graphs/inplace_decoder.py; `past_present_share_buffer` set from its layout:
genai allocates the cache once and the graph writes it in place), with the session's threads overlaid so
that they match ours (genai_config.json has no key for ORT's spin-waiting; genai's own choice stands, and
the report says so). The prompts of a batch are of equal length: no padding (that graph pads on the
right, genai's shared-buffer rule).

Scenarios: prefill (a fresh generator and `append_tokens(prompt)`: the prompt through the graph, the
cache kept) and generate (greedy, exactly `new_tokens` tokens). One decode step on a given past cache has
no call in genai (its generator owns the cache), so that scenario is skipped with that reason; its cost
is inside generate.
"""

from __future__ import annotations

import importlib.util
import json

import numpy as np

from .base import Backend, Unavailable
from .ort import CACHES


class GenaiBackend(Backend):
    name = "genai"
    spins = True  # ORT's default, which genai_config.json cannot change (its threads used 1.99 cores of 2)

    def check(self):
        if importlib.util.find_spec("onnxruntime_genai") is None:
            return "onnxruntime-genai is not installed (pip install 'andrea-export[genai]')"
        return None

    def setup(self, ctx):
        import onnxruntime_genai as og

        self.ctx = ctx
        self.og = og
        return {"threads": ctx.threads, "inter_op_threads": 1, "provider": "cpu", "graph_optimization": "ORT_ENABLE_ALL",
                "spin_wait": "onnxruntime-genai's own (genai_config.json cannot set it)",
                "config": "genai_config.json as the build writes it, session threads overlaid",
                "decoder_graph": CACHES["inplace"],
                "version": getattr(og, "__version__", None)}  # fmt: skip

    def prepare(self, scenarios):
        from ...deploy.genai import write_genai_config

        decoder = self.ctx.inplace_decoder_onnx()
        write_genai_config(decoder)  # what `build` writes (always afresh: the config follows genai.py, not the cache)
        config = self.og.Config(str(decoder.parent))
        threads = {"intra_op_num_threads": self.ctx.threads, "inter_op_num_threads": 1,
                   "graph_optimization_level": "ORT_ENABLE_ALL"}  # fmt: skip
        config.overlay(json.dumps({"model": {"decoder": {"session_options": threads}}}))
        self.model = self.og.Model(config)

    def _generator(self, ids: np.ndarray, new_tokens: int):
        og = self.og
        params = og.GeneratorParams(self.model)
        length = ids.shape[1] + new_tokens
        params.set_search_options(max_length=length, min_length=length, do_sample=False, batch_size=ids.shape[0])
        gen = og.Generator(self.model, params)
        gen.append_tokens(ids)
        return gen

    def prefill(self, ids):
        ids = ids.astype(np.int32)
        return lambda: self._generator(ids, 1)

    def decode(self, ids, mask, past):
        raise Unavailable("onnxruntime-genai has no call for one step on a given past cache (its generator owns "
                          "the cache); its decode steps are timed inside generate")  # fmt: skip

    def generate(self, prompt, new_tokens):
        """Greedy, exactly `new_tokens` tokens: [B, new_tokens] token ids."""
        prompt = prompt.astype(np.int32)

        def run():
            gen = self._generator(prompt, new_tokens)
            out = []
            while not gen.is_done():
                gen.generate_next_token()
                out.append(np.array(gen.get_next_tokens()))
            return np.stack(out, axis=1)

        return run

"""Verification against the PyTorch reference: Polygraphy comparisons (compare.py), the KV-cache decoders'
step-by-step checks and greedy agreement (agreement.py), the engines' checks (engine.py), a whole build folder
(folder.py), and what each precision is allowed (thresholds.py)."""

from .._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "compare": ["TorchRunner", "VerifyReport", "check_inputs", "onnxrt_runner", "print_summary", "reference_model_for",
                "verify"],
    "agreement": ["greedy_agreement", "verify_decoder"],
    "folder": ["verify_folder"],
    "thresholds": ["MAX_KL", "MAX_PPL_REL", "MIN_TOP1", "MIN_TOP5", "TOLERANCES", "TOP1_TIE", "TOP5_TIE"],
})

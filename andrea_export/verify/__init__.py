"""Verification against the PyTorch reference: Polygraphy comparisons (compare.py) of its runners (runners.py)
on the inputs (inputs.py), judged also by language-model figures (metrics.py), into a report (report.py); the
reference model of an ONNX file (reference.py), the KV-cache decoders' step-by-step checks and greedy agreement
(agreement.py), the engines' checks (engine.py), a whole build folder (folder.py), and what each precision is
allowed (thresholds.py)."""

from .._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "compare": ["verify"],
    "runners": ["InplaceRunner", "TorchRunner", "onnxrt_runner"],
    "inputs": ["check_inputs", "default_shapes"],
    "metrics": ["lm_metrics", "lm_passed", "lm_thresholds"],
    "report": ["VerifyReport", "print_summary"],
    "reference": ["reference_model_for"],
    "agreement": ["greedy_agreement", "verify_decoder"],
    "folder": ["verify_folder"],
    "thresholds": ["MAX_KL", "MAX_PPL_REL", "MIN_TOP1", "MIN_TOP5", "TOLERANCES", "TOP1_TIE", "TOP5_TIE"],
})

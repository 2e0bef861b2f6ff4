"""TensorRT and TensorRT-RTX engines: the builder (builder.py), which backend builds and its module (backends.py),
optimization profiles (profiles.py), compatibility and target checks (compat.py), what TensorRT logs
(log.py), and refitting a weight-stripped engine at load (refit.py)."""

from .._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "builder": ["BuildResult", "OPT_LEVELS", "build_engine"],
    "backends": ["BUILDERS", "resolve_builder", "trt_module"],
    "profiles": ["Bounds", "Profile", "Profiles", "parse_profiles"],
    "compat": ["check_engine_compat", "check_targets", "normalize_compute_capabilities"],
    "refit": ["refit_stripped", "sidecar_path"],
})

"""The build folder as untrusted input and as our output: atomic writes and the folder swap (atomic.py), the
manifest, its artifacts and sidecars read with every path confined to the folder (reader.py)."""

from .._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "atomic": ["atomic_path", "cache_dir", "locked_folder", "sha256_file", "staging", "swap_folders", "update_folder",
               "write_text_atomic"],
    "reader": ["MANIFEST", "changed_artifacts", "check_weights_source", "inside", "metadata_json", "read_engine_info",
               "read_manifest"],
})

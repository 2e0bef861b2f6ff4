"""The build folder as untrusted input and as our output: atomic writes and the folder swap (atomic.py), the
manifest, its artifacts and sidecars read with every path confined to the folder (reader.py)."""

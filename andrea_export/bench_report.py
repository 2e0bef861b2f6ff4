"""The benchmark's result document: moved to `andrea_export.bench.report`; this name stays for the code
and scripts that import it."""

from .bench.report import *  # noqa: F401,F403
from .bench.report import BenchSchemaError, _fmt, _shape  # noqa: F401  (names star-import leaves out)

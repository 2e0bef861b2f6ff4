"""Latency benchmarks: PyTorch eager vs ONNX Runtime vs TensorRT engines, on the same weights and inputs,
each figure set beside the machine's own limits measured in the same run.

Method (benchmarks/README.md says it in prose):

* Every backend gets the same model weights and the same input arrays.
* Warm-up rounds, then timed rounds; backends are **interleaved**, the first one rotating per round
  (A B C, B C A, ...), so slow drift of the
  machine (other load, clocks, thermal) hits all of them alike, and speedups are the **median of
  per-iteration ratios** t_baseline[i] / t_backend[i], in which such drift cancels.
* Times come from `time.perf_counter_ns` around a synchronous call (CUDA events for TensorRT on a GPU).
  Statistics: min, median, mean, p90, p99 (linear interpolation between order statistics, as numpy's
  default), coefficient of variation = sample std / mean.
* Threads are set explicitly: `torch.set_num_threads(n)`, ORT `intra_op_num_threads = n`,
  `inter_op_num_threads = 1`; n defaults to the CPUs this process may use.
* The physical limits are measured in the same run with the same threads: memory bandwidth (a large
  tensor copy, bytes read + written / time, and a large sum, bytes read / time; the higher counts) and
  fp32 matmul rate (a large square matmul). Each scenario's **floor** is the roofline bound
  max(FLOPs / matmul rate, bytes / bandwidth) of the work it cannot avoid (see `forward_flops` and
  `forward_bytes`); each result is reported as a multiple of its floor (`x_floor`) with its achieved
  GFLOP/s and GB/s.

Everything is usable from Python: `run_benchmark(...)` returns the result document (`report`'s
schema) and writes JSON, CSV, Markdown and PNG plots when given `out`.

The peers (what users would run instead: Optimum's own export of the same weights, onnxruntime-genai on
the build folder) run in the same rounds with the same session options and are reported as their time
over ours (`ort-cpu`), per case (`x_ours` on every row; the document's "peers" section). `ort-cpu` runs
the in-place decoder, as the runtime gives the CPU provider; `ort-cpu-concat` runs the standard one, so a
run shows the in-place cache's gain (the document's "inplace" section).

The package, each part readable on its own:

    harness.py   Settings, interleaved rounds, clocks, statistics
    machine.py   the machine's limits (bandwidth, matmul rate) and the environment
    work.py      scenarios, grids, FLOPs/bytes of the work, floors, the shared inputs
    backends/    one module per backend (base.py: the interface and the shared Context): mem, pytorch,
                 ort (ort-cpu, ort-cpu-concat, ort-cuda), tensorrt, and the peers optimum and genai
    goals.py     the goals, reported never asserted
    run.py       run_benchmark: one run from cases to the result document
    report.py    the result document's schema: JSON, CSV, Markdown, plots, compare
    load.py      the served model under load (`bench --serve`): the real Triton server, streaming clients
"""

from __future__ import annotations

from .backends import (
    BACKENDS,
    DEFAULT_BACKENDS,
    Context,
    GenaiBackend,
    LlamaCppBackend,
    MemReadBackend,
    OptimumBackend,
    OrtBackend,
    TorchBackend,
    TrtBackend,
    Unavailable,
    make_backends,
)
from .goals import goals
from .harness import Settings, Stats, interleaved_order, percentile, ratio_median, run_interleaved
from .machine import combine_limits, environment, measure_machine
from .report import OURS, PEERS, peers
from .run import parse_engine_specs, parse_names, run_benchmark
from .work import (
    SCENARIOS,
    attention_flops,
    floor_seconds,
    forward_bytes,
    forward_flops,
    matmul_params,
    scenario_work,
    weight_bytes,
)

__all__ = [
    "BACKENDS", "DEFAULT_BACKENDS", "Context", "GenaiBackend", "LlamaCppBackend", "MemReadBackend", "OptimumBackend", "OrtBackend",
    "TorchBackend", "TrtBackend", "Unavailable", "make_backends",
    "goals",
    "Settings", "Stats", "interleaved_order", "percentile", "ratio_median", "run_interleaved",
    "combine_limits", "environment", "measure_machine",
    "OURS", "PEERS", "peers",
    "parse_engine_specs", "parse_names", "run_benchmark",
    "SCENARIOS", "attention_flops", "floor_seconds", "forward_bytes", "forward_flops", "matmul_params", "scenario_work",
    "weight_bytes",
]  # fmt: skip

"""The one script a GPU host runs for the tanh-GELU plugin kernel:

  1. compile the kernel with andrea_export.plugin.compile (NVRTC, pinned) and load the PTX through the
     driver (CuPy): this also proves the driver accepts the PTX ISA we emit;
  2. correctness for float32 / float16 / bfloat16, plain and bias variants, odd lengths, misaligned
     offsets, NaN-poisoned outputs, fresh inputs each case: against the float64 reference with the GPU
     error bound (reference.error_bound(device="gpu")) and against torch's gelu(approximate="tanh");
  3. speed on 64M fp16 elements: ours vs torch's GELU vs a device-to-device copy (goal: >= 90 % of copy);
  4. if TensorRT imports: plugin engine vs native-GELU engine (andrea_export.build.build_engine), else
     "skipped: <reason>".

Prints a short table last; exit 0 when every check passed, 1 when one failed, 2 when it cannot run here.

    python benchmarks/gpu_checks.py [--n 67108864]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gelu_kernel import NoGpu, bench, check, load, require_gpu  # noqa: E402

COPY_GOAL_PCT = 90.0


def tensorrt_engines() -> tuple[str, str]:
    """(status, detail) of the plugin-vs-native engine comparison."""
    try:
        import tensorrt  # noqa: F401

        from andrea_export.build import build_engine  # noqa: F401  (the lead's builder)
        from andrea_export.plugin.register import register_plugins
    except ImportError as e:
        return "skipped", f"skipped: {e}"
    try:
        ids = register_plugins()
    except Exception as e:  # noqa: BLE001 - report, do not hide
        return "FAIL", f"register_plugins failed: {e}"
    # The engine comparison itself belongs to andrea_export.build / benchmarks/latency.py; this hook only
    # proves the registration works on this host until that lands.
    return "ok", f"registered {', '.join(ids)}; engine comparison: run benchmarks/latency.py"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=64 << 20, help="elements for the timing run (fp16)")
    args = ap.parse_args(argv)
    try:
        torch, cupy = require_gpu()
    except NoGpu as e:
        print(f"gpu_checks: {e}", file=sys.stderr)
        return 2

    table: list[tuple[str, str, str]] = []
    name = torch.cuda.get_device_name()
    kern = load(torch, cupy)
    table.append(("PTX load", "ok", f"{kern.arch}, PTX ISA {kern.ptx_isa}, needs {kern.driver_floor}; {name}"))

    ok = True
    for r in check(torch, cupy, kern):
        passed = r["failures"] == 0
        ok &= passed
        table.append((f"{r['dtype']} {r['variant']}", "ok" if passed else "FAIL",
                      f"{r['cases']} cases, max err/bound {r['max_err_over_bound']:.3f}, "
                      f"max |ours - torch| {r['max_abs_diff_vs_torch']:.3g}"))  # fmt: skip

    b: dict[str, Any] = bench(torch, cupy, kern, n=args.n)
    fast = b["pct_of_copy"] >= COPY_GOAL_PCT
    table.append(("speed fp16", "ok" if fast else "SLOW",
                  f"{b['n']} elems: ours {b['ours_us']:.1f} us ({b['ours_GBps']:.0f} GB/s), torch gelu "
                  f"{b['torch_gelu_us']:.1f} us, D2D copy {b['copy_us']:.1f} us; {b['pct_of_copy']:.0f}% of copy "
                  f"(goal >= {COPY_GOAL_PCT:.0f}%)"))  # fmt: skip

    status, detail = tensorrt_engines()
    ok &= status != "FAIL"
    table.append(("TensorRT plugin", status, detail))

    width = max(len(r[0]) for r in table)
    print()
    for check_name, status, detail in table:
        print(f"{check_name:<{width}}  {status:<7}  {detail}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

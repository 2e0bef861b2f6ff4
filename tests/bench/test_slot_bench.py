"""benchmarks/slot_decoder.py runs end to end on the tiny model: both graphs timed through the slot cache for a
decode step and a mixed one, each figure beside its floor, the table and the JSON record written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_slot_benchmark_writes_both_graphs_with_their_floors(tmp_path):
    out = tmp_path / "slots.md"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "slot_decoder.py"), "--config", "andrea-tiny", "--rounds", "1",
           "--cases", "2:20:0,2:20:8,1:200:0", "--cache-dir", str(tmp_path / "graphs"), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rows 1 past 200 chunk 0: beyond andrea-tiny's context, left out" in proc.stdout
    cases = json.loads(out.with_suffix(".json").read_text())["cases"]
    assert [(c["rows"], c["past"], c["chunk"]) for c in cases] == [(2, 20, 0), (2, 20, 8)]
    for case in cases:
        for graph in ("inplace", "slots"):
            assert case[graph]["median_ms"] > 0 and 0 < case[graph]["floor_ms"]
        # the slot graph's attention reads every row's whole static cache: more bytes than the filled part
        assert case["slots"]["bytes"] > case["inplace"]["bytes"]
    assert out.read_text().count("\n| 2 | 20 |") == 2

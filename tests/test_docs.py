"""The manual (docs/, mkdocs.yml) builds with `mkdocs build --strict`: a broken link, a link to a missing
heading, or an API reference (`::: name`) to a name that does not exist fails the build, and so this test.
And the README stays a first page: short, every relative link pointing at a file that exists."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200


def test_the_manual_builds_strictly(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's banner about MkDocs 2, not a warning of ours
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
                          "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    site = tmp_path / "site"
    assert (site / "index.html").is_file()
    # the API reference was generated from the docstrings, not left as a bare `:::` line
    runtime_page = (site / "reference" / "runtime" / "index.html").read_text()
    assert 'id="andrea_export.runtime.load"' in runtime_page
    # the repository's own documents the manual links to are part of the site (docs/hooks/repository_files.py)
    assert (site / "repo" / "benchmarks" / "index.html").is_file()


def test_the_readme_is_a_first_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < README_MAX_LINES, "the README grew: move the detail into the manual (docs/)"
    assert not re.search(r"\bissue \d+|#\d+\b", text, re.I), "the README names an issue number an outsider cannot open"
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target:
            continue
        assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"

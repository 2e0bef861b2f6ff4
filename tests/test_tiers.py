"""The quick tier (`make test-quick`, `pytest -m "not heavy"`): tests/conftest.py's lists name what exists, and a
test is heavy through a heavy fixture it needs (directly or through another fixture), by its name, by its file or
by `slow`; everything else stays in the quick tier."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def tiers(request):
    """tests/conftest.py as pytest loaded it (`import conftest` could find another directory's conftest)."""
    return request.config.pluginmanager.get_plugin(str(ROOT / "tests" / "conftest.py"))


def test_every_heavy_entry_names_something_that_exists(tiers):
    missing = [f for f in tiers.HEAVY_FILES if not (ROOT / f).is_file()]
    missing += [t for t in tiers.HEAVY_TESTS if not re.search(rf"^def {t.split('::')[1]}\(", (ROOT / t.split("::")[0]).read_text(), re.M)]
    missing += [f"{f}::{name}" for f, name in tiers.HEAVY_FIXTURES
                if not re.search(rf"@pytest\.fixture.*\n(?:@.*\n)*def {name}\(", (ROOT / f).read_text())]
    assert not missing, missing


def selected(*args: str) -> set[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                         capture_output=True, text=True, cwd=ROOT).stdout
    return {line.split("[")[0] for line in out.splitlines() if "::" in line}


def test_the_quick_tier_leaves_out_what_is_heavy_and_only_that():
    quick = selected("-m", "not heavy", "tests/test_pipeline.py", "tests/graphs/test_export.py")
    assert "tests/test_pipeline.py::test_build_folder_contract" in quick  # tiny_build: seconds, stays
    assert "tests/graphs/test_export.py::test_export_is_deterministic_and_atomic" in quick
    for heavy in ["tests/test_pipeline.py::test_verify_of_a_checkpoint_build_says_the_command_with_its_checkpoint",  # lively_build
                  "tests/test_pipeline.py::test_generate_prints_text_with_the_folder_tokenizer",  # demo_fp16_build
                  "tests/test_pipeline.py::test_bf16_build_perplexity_within_one_percent",  # by name
                  "tests/graphs/test_export.py::test_full_size_export"]:  # slow
        assert heavy not in quick

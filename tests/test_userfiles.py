"""userfiles' JSON depth check, which runs on every manifest, sidecar, config and checkpoint index a user hands
us before it is parsed: it measures what json.loads would nest, and reads any text in linear time."""

import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from andrea_export.errors import BuildError
from andrea_export.userfiles import MAX_JSON_DEPTH, _depth, loads_json

_text = st.text(alphabet=st.sampled_from('ab[]{}"\\\n/u'), max_size=12)
_json = st.recursive(st.none() | st.booleans() | st.integers() | _text,
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
                     max_leaves=20)


def _nesting(value) -> int:
    if isinstance(value, list):
        return 1 + max(map(_nesting, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_nesting, value.values()), default=0)
    return 0


@settings(max_examples=300, deadline=None)
@given(value=_json)
def test_the_depth_is_the_nesting_json_loads_builds(value):
    """Brackets, quotes and backslashes inside strings do not count; escaped quotes do not end a string."""
    assert _depth(json.dumps(value)) == _nesting(value)
    assert _depth(json.dumps(value, indent=1, ensure_ascii=False)) == _nesting(value)


@pytest.mark.parametrize("hostile", ['"' + '\\"' * 200_000, '{"a": "' + '\\\\\\"' * 100_000, '"' * 400_000,
                                     '["' * 200_000, "[" * 200_000])  # fmt: skip
def test_any_text_is_measured_in_linear_time(hostile):
    """400 kB that a pattern retried from every quote reads in quadratic time (80 kB of escaped quotes took 15 s
    with one) is one clear error at once; 2 s is hundreds of times what a linear read takes."""
    t0 = time.perf_counter()
    with pytest.raises(BuildError, match="not valid JSON|deeper than"):
        loads_json(hostile, "manifest.json", "the manifest", BuildError)
    assert time.perf_counter() - t0 < 2.0


def test_deeper_than_the_bound_is_refused_and_the_bound_itself_is_read():
    deep = "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1)
    with pytest.raises(BuildError, match=f"deeper than {MAX_JSON_DEPTH}"):
        loads_json(deep, "m.json", "the manifest", BuildError)
    ok = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert _nesting(loads_json(ok, "m.json", "the manifest", BuildError)) == MAX_JSON_DEPTH

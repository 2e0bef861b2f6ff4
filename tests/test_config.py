import json
from pathlib import Path

import pytest

from andrea_export.config import ANDREA_120M, PRESETS, ModelConfig, load_config
from andrea_export.errors import ConfigError

MODELS = Path(__file__).parent.parent / "models"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_model_files_equal_presets(name):
    assert load_config(MODELS / f"{name}.json") == PRESETS[name]
    assert load_config(name) is PRESETS[name]


def test_andrea_120m_parameter_count_from_config():
    assert ANDREA_120M.n_params == 92_331_264
    assert ANDREA_120M.head_dim == 64


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("n_layer", 0, "field 'n_layer' must be a positive integer, got 0"),
        ("vocab_size", "big", "field 'vocab_size' must be a positive integer, got 'big'"),
        ("n_head", 5, "field 'n_head' (5) must divide 'n_embd' (768)"),
        ("layer_norm_eps", -1, "field 'layer_norm_eps' must be a number in (0, 1), got -1"),
    ],
)
def test_bad_field_is_named(tmp_path, field, value, message):
    data = ANDREA_120M.to_dict() | {field: value}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert message in str(e.value)
    assert str(path) in str(e.value)


def test_unknown_field_and_bad_json(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(ANDREA_120M.to_dict() | {"n_heads": 12}))
    with pytest.raises(ConfigError, match=r"unknown field\(s\) n_heads; known fields: "):
        load_config(path)
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(path)


def test_unknown_name():
    with pytest.raises(ConfigError, match="no model config 'gpt-5': not a preset \\(andrea-120m, andrea-tiny\\) and not a file"):
        load_config("gpt-5")


def test_from_dict_rejects_non_object():
    with pytest.raises(ConfigError, match="expected a JSON object, got list"):
        ModelConfig.from_dict([1, 2])


NAME_CASES = [  # (name, usable): one rule for a model name and a Triton model name (both name folders)
    ("a", True), ("A9", True), ("9a", True), ("andrea-tiny_v1.2", True), ("a..b", True), ("a" * 128, True),
    ("a" * 129, False), ("a" * 100, True),  # the old model-name rule stopped at 64, Triton's at 128
    ("", False), (".", False), ("..", False), (".hidden", False), ("-x", False),
    ("_x", False),  # the old Triton rule took a leading '_', the model-name rule did not
    ("a/b", False), ("../x", False), ("a b", False), ("a\nb", False), ("é", False), ("a:b", False),
]


@pytest.mark.parametrize("name,usable", NAME_CASES)
def test_one_name_rule_for_model_names_and_triton_model_names(name, usable):
    """A model config and Triton packaging (which refuses a bad name before it reads anything) accept exactly the
    same names: the old rules differed at 65-128 characters and at a leading '_'."""
    from andrea_export.deploy.triton.stateful import decoder_config
    from andrea_export.errors import PackageError

    try:
        model_ok = ModelConfig(name=name).name == name
    except ConfigError as e:
        assert "field 'name' must be 1-128 letters" in str(e)
        model_ok = False
    try:
        decoder_config(None, Path("no-such-decoder.onnx"), name)
    except PackageError as e:
        triton_ok = "a Triton model name must be 1-128 letters" not in str(e)
    except Exception:  # noqa: BLE001: the name passed; what comes next (no graph) is not the subject
        triton_ok = True
    assert (model_ok, triton_ok) == (usable, usable)

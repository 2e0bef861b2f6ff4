"""Weight-stripped engines (--strip-weights): full TensorRT on a GPU host builds them (STRIP_PLAN +
REFIT_IDENTICAL) and `build.refit_stripped` refits them from the ONNX weights at load. Neither runs here:
TensorRT-RTX's CPU builder fails with these flags (checked below, for real), so it is refused with a clear
error; the refit path runs against a stand-in that enforces TensorRT's refit contract."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from andrea_export.engine.builder import build_engine
from andrea_export.engine.refit import STRIP_REFUSED_RTX, refit_stripped
from andrea_export.errors import BuildError, ConfigError
from andrea_export.graphs.external_data import share_weights

needs_rtx = pytest.mark.skipif(not __import__("importlib").util.find_spec("tensorrt_rtx"),
                               reason="TensorRT-RTX not installed: pip install 'andrea-export[rtx]'")


@needs_rtx
def test_rtx_refuses_weight_stripped_engines_before_work(tiny_onnx, tmp_path):
    with pytest.raises(ConfigError, match="need full TensorRT on a GPU host .*TensorRT-RTX's ahead-of-time CPU builder fails"):
        build_engine(tiny_onnx, tmp_path / "s.plan", builder="tensorrt-rtx", strip_weights=True, progress=False)
    assert list(tmp_path.iterdir()) == []


@needs_rtx
def test_rtx_cpu_builder_indeed_fails_with_strip_plan(tiny_onnx):
    """The fact behind the refusal. If a TensorRT-RTX release builds these here, lift the refusal."""
    import tensorrt_rtx as trt

    logger = trt.Logger(trt.Logger.INTERNAL_ERROR)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    assert trt.OnnxParser(network, logger).parse_from_file(str(tiny_onnx))
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    profile.set_shape("input_ids", (1, 1), (1, 8), (1, 16))
    config.add_optimization_profile(profile)
    config.set_flag(trt.BuilderFlag.STRIP_PLAN)
    config.set_flag(trt.BuilderFlag.REFIT_IDENTICAL)
    assert builder.build_serialized_network(network, config) is None, "TensorRT-RTX now strips on a CPU: see STRIP_REFUSED_RTX"
    assert "STRIP_PLAN" in STRIP_REFUSED_RTX


# --------------------------------------------------------------------------------- refit, through a stand-in


class FakeEngine:
    """A weight-stripped engine: the refittable weights it names, with their element counts."""

    def __init__(self, counts: dict[str, int]):
        self.counts = counts
        self.weights: dict[str, np.ndarray] = {}
        self.refitted = False


class FakeTrt:
    """TensorRT's refit API as documented: `Refitter(engine, logger)`; `OnnxParserRefitter(refitter, logger)
    .refit_from_file(path: str)` reads the ONNX from its path (external data from beside it: onnx.load does the
    same) and sets each initializer the engine names, with the same element count; `get_missing_weights()`
    lists the names not set; `refit_cuda_engine()` fails while any is missing. Every call is recorded."""

    def __init__(self):
        self.calls: list[str] = []
        trt = self

        class Refitter:
            def __init__(self, engine, logger):
                assert isinstance(engine, FakeEngine) and logger is not None
                trt.calls.append("Refitter")
                self.engine = engine

            def set_named_weights(self, name, array) -> bool:
                if self.engine.counts.get(name) != array.size:
                    return False
                self.engine.weights[name] = array
                return True

            def _missing(self):
                return sorted(set(self.engine.counts) - set(self.engine.weights))

            def get_missing_weights(self):
                trt.calls.append("get_missing_weights")
                return self._missing()

            def refit_cuda_engine(self) -> bool:
                trt.calls.append("refit_cuda_engine")
                if self._missing():
                    return False
                self.engine.refitted = True
                return True

        class Error:
            def __init__(self, desc):
                self._desc = desc

            def desc(self):
                return self._desc

        class OnnxParserRefitter:
            def __init__(self, refitter, logger):
                assert isinstance(refitter, Refitter)
                trt.calls.append("OnnxParserRefitter")
                self.refitter, self.errors = refitter, []

            @property
            def num_errors(self):
                return len(self.errors)

            def get_error(self, i):
                return self.errors[i]

            def refit_from_file(self, path) -> bool:
                assert isinstance(path, str)
                trt.calls.append("refit_from_file")
                try:
                    model = onnx.load(path)
                except Exception as e:
                    self.errors.append(Error(str(e)))
                    return False
                for t in model.graph.initializer:
                    if t.name in self.refitter.engine.counts and not self.refitter.set_named_weights(
                            t.name, numpy_helper.to_array(t)):
                        self.errors.append(Error(f"weights '{t.name}' have the wrong count"))
                        return False
                return True

        self.Refitter, self.OnnxParserRefitter = Refitter, OnnxParserRefitter

    class Logger:
        WARNING = 2

        def __init__(self, *a):
            pass


@pytest.fixture
def shipped(tiny_onnx, tmp_path):
    """What a stripped build ships: model.onnx pointing into its weights file, and the plan's sidecar."""
    shutil.copyfile(tiny_onnx, tmp_path / "model.onnx")
    share_weights([tmp_path / "model.onnx"], tmp_path / "weights.fp32.data")
    (tmp_path / "model.plan").write_bytes(b"stand-in: a plan is never read by refit_stripped")
    info = {"builder": "tensorrt", "weights_stripped": True, "onnx": "model.onnx", "plugin_layers": 0}
    counts = {t.name: int(np.prod(t.dims)) for t in onnx.load(str(tiny_onnx)).graph.initializer}
    return tmp_path, info, counts


def test_refit_puts_every_weight_back_from_the_shared_weights_file(shipped, tiny_onnx):
    folder, info, counts = shipped
    trt, engine = FakeTrt(), FakeEngine(counts)
    assert refit_stripped(trt, engine, folder / "model.plan", info, logger=trt.Logger()) is True
    assert trt.calls == ["Refitter", "OnnxParserRefitter", "refit_from_file", "get_missing_weights",
                         "refit_cuda_engine"]
    assert engine.refitted
    for t in onnx.load(str(tiny_onnx)).graph.initializer:
        np.testing.assert_array_equal(engine.weights[t.name], numpy_helper.to_array(t))


def test_an_engine_with_its_weights_is_left_alone(shipped):
    folder, info, counts = shipped
    trt = FakeTrt()
    assert refit_stripped(trt, FakeEngine(counts), folder / "model.plan", info | {"weights_stripped": False}) is False
    assert trt.calls == []


@pytest.mark.parametrize("onnx_name", ["../model.onnx", "sub/model.onnx", "", ".."])
def test_the_sidecar_cannot_send_the_refit_outside_the_folder(shipped, onnx_name):
    folder, info, counts = shipped
    trt = FakeTrt()
    with pytest.raises(BuildError, match="'onnx' \\(the graph to refit from\\): .*(outside the build folder|not a file name)"):
        refit_stripped(trt, FakeEngine(counts), folder / "model.plan", info | {"onnx": onnx_name})
    assert trt.calls == []


def test_the_sidecar_cannot_refit_through_a_symlink_out_of_the_folder(shipped, tmp_path_factory):
    """A plain file name is not enough: a symlink beside the plan may point at a graph elsewhere."""
    folder, info, counts = shipped
    elsewhere = tmp_path_factory.mktemp("elsewhere") / "model.onnx"
    elsewhere.write_bytes((folder / info["onnx"]).read_bytes())
    (folder / "link.onnx").symlink_to(elsewhere)
    trt = FakeTrt()
    with pytest.raises(BuildError, match="outside the build folder"):
        refit_stripped(trt, FakeEngine(counts), folder / "model.plan", info | {"onnx": "link.onnx"})
    assert trt.calls == []


def test_a_missing_weights_file_is_refused_before_tensorrt_reads(shipped):
    folder, info, counts = shipped
    (folder / "weights.fp32.data").unlink()
    trt = FakeTrt()
    with pytest.raises(BuildError, match="cannot refit its weights: .*'weights.fp32.data' of tensor .* is missing"):
        refit_stripped(trt, FakeEngine(counts), folder / "model.plan", info)
    assert trt.calls == []


def test_a_graph_that_is_not_the_engines_is_refused(shipped):
    folder, info, counts = shipped
    trt = FakeTrt()
    with pytest.raises(BuildError, match=r"does not give every weight the engine needs \(missing: h.9.attn"):
        refit_stripped(trt, FakeEngine(counts | {"h.9.attn.c_attn.weight": 12}), folder / "model.plan", info,
                       logger=trt.Logger())
    assert "refit_cuda_engine" not in trt.calls
    wrong = {name: n + 1 for name, n in counts.items()}
    with pytest.raises(BuildError, match="refitting its weights from model.onnx failed: weights '.*' have the wrong count"):
        refit_stripped(FakeTrt(), FakeEngine(wrong), folder / "model.plan", info, logger=trt.Logger())


def test_the_cli_and_the_build_options_carry_the_flag(tmp_path):
    from click.testing import CliRunner

    from andrea_export.cli import main
    from andrea_export.pipeline import BuildOptions

    assert BuildOptions().strip_weights is False
    assert "strip_weights = true" in BuildOptions(strip_weights=True).to_toml()
    result = CliRunner().invoke(main, ["build", "--help"])
    assert "--strip-weights" in result.output
    if __import__("importlib").util.find_spec("tensorrt_rtx"):
        result = CliRunner().invoke(main, ["build", "--config", "andrea-tiny", "--builder", "tensorrt-rtx",
                                           "--strip-weights", "--out", str(tmp_path / "b")])
        assert result.exit_code == 1 and "need full TensorRT on a GPU host" in result.output
        assert "Traceback" not in result.output and not (tmp_path / "b").exists()  # refused before any work

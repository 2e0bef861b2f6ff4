"""One weights file shared by the graphs of a precision: each tensor stored once (by content, whatever its
name), and every consumer reading the shared form from the graph's path gives what it gave from the
self-contained graphs: ONNX Runtime (standard, plugin and decoder graphs), the TensorRT-RTX parser,
Polygraphy and the runtime. External-data locations come from untrusted files: the refusals are here too."""

from __future__ import annotations

import os
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx.external_data_helper import ExternalDataInfo, uses_external_data

from andrea_export.config import ANDREA_TINY
from andrea_export.errors import BuildError, ExportError
from andrea_export.graphs.external_data import external_data_files, share_weights
from andrea_export.graphs.layout import check_onnx

GRAPHS = ("model.onnx", "model.plugin.onnx", "decoder.onnx")
DATA = "weights.fp32.data"


@pytest.fixture(scope="module")
def inline(tiny_model, tiny_onnx, tmp_path_factory):
    """The three graphs of the tiny model, each holding its own weights (as the exporters write them)."""
    from andrea_export.graphs.gelu_plugin import apply_gelu_plugin
    from andrea_export.graphs.kvcache import export_decoder_onnx

    d = tmp_path_factory.mktemp("inline")
    shutil.copyfile(tiny_onnx, d / "model.onnx")
    apply_gelu_plugin(d / "model.onnx", d / "model.plugin.onnx")
    export_decoder_onnx(tiny_model, d / "decoder.onnx", quiet=True)
    return d


@pytest.fixture(scope="module")
def shared(inline, tmp_path_factory):
    d = tmp_path_factory.mktemp("shared")
    for g in GRAPHS:
        shutil.copyfile(inline / g, d / g)
    report = share_weights([d / g for g in GRAPHS], d / DATA)
    return d, report


def _ranges(path) -> dict[str, tuple[str, int, int]]:
    """{initializer: (location, offset, length)} of the external ones."""
    out = {}
    for t in onnx.load(str(path), load_external_data=False).graph.initializer:
        if uses_external_data(t):
            info = ExternalDataInfo(t)
            out[t.name] = (info.location, info.offset, info.length)
    return out


def test_each_tensor_is_stored_once_whatever_its_name(inline, shared):
    d, report = shared
    weights = ANDREA_TINY.n_params * 4
    assert sorted(p.name for p in d.iterdir()) == sorted([*GRAPHS, DATA])  # no temporary files left
    total = sum(p.stat().st_size for p in d.iterdir())
    assert total <= 1.1 * weights, f"{total} bytes for {weights} bytes of weights"
    assert sum(p.stat().st_size for p in inline.iterdir()) > 3 * weights  # what it was
    assert report.bytes == (d / DATA).stat().st_size < 1.01 * weights
    assert report.references > 2 * report.tensors and report.referenced_bytes > 2.9 * weights
    model, plugin, decoder = (_ranges(d / g) for g in GRAPHS)
    assert {loc for r in (model, plugin, decoder) for loc, _, _ in r.values()} == {DATA}
    assert model == plugin
    # the decoder's tensors are the model's, partly under other names (the exporter's folded transposes)
    assert set(model.values()) <= set(decoder.values())
    assert model["wte.weight"] == decoder["wte.weight"]
    assert set(model) != set(decoder)
    # the tied embedding is still one initializer: no other range of the vocabulary's size
    vocab_sized = [t.name for t in onnx.load(str(d / "model.onnx"), load_external_data=False).graph.initializer
                   if ANDREA_TINY.vocab_size in t.dims]
    assert vocab_sized == ["wte.weight"]
    for g in GRAPHS:
        check_onnx(d / g)  # onnx.checker with the weights beside it
        assert external_data_files(d / g) == {DATA: report.bytes}


def _decoder_feed(n_past=0, tokens=5):
    L, H, D = ANDREA_TINY.n_layer, ANDREA_TINY.n_head, ANDREA_TINY.head_dim
    rng = np.random.default_rng(0)
    feed = {"input_ids": rng.integers(0, ANDREA_TINY.vocab_size, (2, tokens), dtype=np.int64),
            "attention_mask": np.ones((2, n_past + tokens), np.int64)}
    for i in range(L):
        for kv in ("key", "value"):
            feed[f"past_key_values.{i}.{kv}"] = rng.standard_normal((2, H, n_past, D)).astype(np.float32)
    return feed


@pytest.mark.parametrize("graph", GRAPHS)
def test_onnx_runtime_gives_the_same_numbers(inline, shared, graph):
    feed = _decoder_feed(n_past=3) if graph == "decoder.onnx" else {
        "input_ids": np.random.default_rng(0).integers(0, ANDREA_TINY.vocab_size, (2, 7), dtype=np.int64)}
    got, want = (ort.InferenceSession(str(d / graph), providers=["CPUExecutionProvider"]).run(None, feed)
                 for d in (shared[0], inline))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("graph", ["model.onnx", "decoder.onnx"])
def test_tensorrt_rtx_parser_reads_the_same_weights(inline, shared, graph):
    """The parser imports each initializer as a constant layer: the same weights, from the shared file."""
    trt = pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX (the 'rtx' extra) parses on a CPU")
    import hashlib

    def constants(path):
        logger = trt.Logger(trt.Logger.ERROR)
        network = trt.Builder(logger).create_network(0)
        parser = trt.OnnxParser(network, logger)
        assert parser.parse_from_file(str(path)), [parser.get_error(i).desc() for i in range(parser.num_errors)]
        out = []
        for i in range(network.num_layers):
            layer = network.get_layer(i)
            if layer.type == trt.LayerType.CONSTANT:
                layer.__class__ = trt.IConstantLayer
                out.append(hashlib.sha256(np.asarray(layer.weights).tobytes()).hexdigest())
        return sorted(out)

    got = constants(shared[0] / graph)
    assert len(got) > 2 * ANDREA_TINY.n_layer and got == constants(inline / graph)


def test_polygraphy_and_the_runtime_read_the_shared_graphs(tiny_model, inline, shared):
    from andrea_export import runtime
    from andrea_export.verify.compare import verify

    d = shared[0]
    report = verify(tiny_model, {"onnxrt": d / "model.onnx", "onnxrt-plugin": d / "model.plugin.onnx"},
                    shapes=[(2, 9)], greedy_steps=2)
    assert report.passed and [c["artifact"] for c in report.comparisons] == ["onnxrt", "onnxrt-plugin"]
    tokens = []
    for folder in (d, inline):
        with runtime.load(folder / "decoder.onnx", "onnxruntime") as sess:
            tokens.append(sess.generate([5, 6, 7], max_new_tokens=6, strategy="top-k", top_k=5, seed=3))
    assert tokens[0] == tokens[1] and len(tokens[0]) == 6


def test_sharing_again_changes_nothing(shared, tmp_path):
    d, report = shared
    for f in d.iterdir():
        shutil.copyfile(f, tmp_path / f.name)
    again = share_weights([tmp_path / g for g in GRAPHS], tmp_path / DATA)
    assert (again.tensors, again.bytes) == (report.tensors, report.bytes)
    for f in d.iterdir():
        assert (tmp_path / f.name).read_bytes() == f.read_bytes(), f.name


def test_own_data_files_are_replaced(inline, tmp_path):
    """A graph exported with its weights in `<graph>.data` (models over 1 GiB) joins the shared file; its own
    file goes away."""
    m = onnx.load(str(inline / "model.onnx"))
    onnx.save(m, str(tmp_path / "model.onnx"), save_as_external_data=True, location="model.onnx.data")
    shutil.copyfile(inline / "decoder.onnx", tmp_path / "decoder.onnx")
    share_weights([tmp_path / "model.onnx", tmp_path / "decoder.onnx"], tmp_path / DATA)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decoder.onnx", "model.onnx", DATA]
    assert external_data_files(tmp_path / "model.onnx") == {DATA: (tmp_path / DATA).stat().st_size}


# ------------------------------------------------------------------------------------ untrusted locations


def _point(shared_dir, tmp_path, location=None, offset=None):
    """A copy of the shared model.onnx whose wte.weight points to `location` / `offset` instead."""
    d = tmp_path / "build"
    d.mkdir()
    shutil.copyfile(shared_dir / DATA, d / DATA)
    m = onnx.load(str(shared_dir / "model.onnx"), load_external_data=False)
    t = next(t for t in m.graph.initializer if t.name == "wte.weight")
    for e in t.external_data:
        if e.key == "location" and location is not None:
            e.value = location
        if e.key == "offset" and offset is not None:
            e.value = str(offset)
    onnx.save(m, str(d / "model.onnx"))
    return d / "model.onnx"


@pytest.mark.parametrize("location, why", [
    ("../weights.fp32.data", "not a plain file name"),
    ("sub/weights.fp32.data", "not a plain file name"),
    ("/etc/passwd", "not a plain file name"),
    ("missing.data", "'missing.data' of tensor 'wte.weight' is missing beside the graph"),
])
def test_locations_that_are_not_plain_names_beside_the_graph_are_refused(shared, tmp_path, location, why):
    path = _point(shared[0], tmp_path, location=location)
    if "/" in location and not location.startswith("/"):
        (path.parent / location).parent.mkdir(exist_ok=True)
        shutil.copyfile(shared[0] / DATA, path.parent / location)  # the file exists where it points: still refused
    with pytest.raises(ExportError, match=why):
        external_data_files(path)
    with pytest.raises(ExportError, match=why):
        check_onnx(path)


def test_a_byte_range_beyond_the_file_is_refused(shared, tmp_path):
    path = _point(shared[0], tmp_path, offset=shared[1].bytes)
    with pytest.raises(ExportError, match="tensor 'wte.weight' reads bytes .* which has .*do not belong together"):
        external_data_files(path)


def test_a_symlinked_weights_file_is_refused_by_every_reader(shared, tmp_path):
    """TensorRT's parser follows a symlink out of the folder (checked: it parses); our readers refuse it
    before the parser sees the graph."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    path = _point(shared[0], tmp_path)
    shutil.move(path.parent / DATA, outside / DATA)
    os.symlink(outside / DATA, path.parent / DATA)
    with pytest.raises(ExportError, match="is a symbolic link beside the graph"):
        check_onnx(path)
    pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX (the 'rtx' extra) parses on a CPU")
    from andrea_export.engine.builder import build_engine

    with pytest.raises(BuildError, match="is a symbolic link beside the graph"):
        build_engine(path, tmp_path / "x.plan", builder="tensorrt-rtx", progress=False)
    assert not (tmp_path / "x.plan").exists()


def test_a_hard_linked_weights_file_is_refused_as_onnx_does(shared, tmp_path):
    path = _point(shared[0], tmp_path)
    os.link(path.parent / DATA, tmp_path / "elsewhere.data")
    with pytest.raises(Exception, match="multiple hard links"):
        onnx.load(str(path))  # onnx's own guard, which our check mirrors with a clearer message
    with pytest.raises(ExportError, match="'weights.fp32.data' has 2 hard links, which onnx refuses"):
        external_data_files(path)


def test_graphs_outside_the_weights_folder_are_refused(shared, tmp_path):
    with pytest.raises(ExportError, match="must be in the folder of its weights file"):
        share_weights([shared[0] / "model.onnx"], tmp_path / DATA)


# ---------------------------------------------------------------------------------------------- full size


@pytest.mark.slow
def test_full_size_build_folder_stores_the_weights_once(tmp_path):
    """ANDREA-120M fp32, default build: the graphs and their weights within 1.1x of the weights (92,331,264
    parameters x 4 bytes = 369 MB; three copies, 1.1 GB, before the graphs shared one file)."""
    pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX (the 'rtx' extra) builds the engines on a CPU")
    from andrea_export.config import ANDREA_120M
    from andrea_export.pipeline import BuildOptions, run_build

    out = tmp_path / "andrea-120m"
    manifest = run_build(BuildOptions(builder="tensorrt-rtx", out=str(out), greedy_steps=2, verify_shapes=[[1, 16]]))
    onnx_part = sum(a["bytes"] for a in manifest["artifacts"].values() if a["path"].endswith((".onnx", ".data")))
    weights = ANDREA_120M.n_params * 4
    print(f"ANDREA-120M fp32: ONNX part {onnx_part / 1e6:.1f} MB for {weights / 1e6:.1f} MB of weights; folder "
          f"{sum(p.stat().st_size for p in out.iterdir()) / 1e6:.1f} MB")
    assert manifest["status"] == "engine-unverified"
    assert onnx_part <= 1.1 * weights
    assert manifest["artifacts"]["weights"]["bytes"] < 1.01 * weights

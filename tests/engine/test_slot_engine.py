"""The slot decoder (graphs/slot_decoder.py) as TensorRT takes it, checked with TensorRT-RTX's ONNX parser (the
onnx-tensorrt code TensorRT's is) and its ahead-of-time builder on this CPU: each TensorScatter becomes a
KV-cache-update layer whose output is the network output `present.*` of its own `past_key_values.*` input,
each Attention an IAttention with a mask, in the one-group graph and the two-group one (two_groups.py); and
both build with the profiles of in-flight batching (decode rows, a prompt's chunk beside them)."""

from __future__ import annotations

import onnx_ir as ir
import pytest

from andrea_export.config import ANDREA_TINY
from andrea_export.engine.builder import build_engine
from andrea_export.errors import ExportError
from andrea_export.graphs.layout import check_decoder_onnx
from andrea_export.graphs.slot_decoder import CHUNK, MIXED, export_slot_decoder, slot_profiles
from andrea_export.graphs.two_groups import PREFIX, two_group_decoder
from andrea_export.names import DECODE

trt = pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX (the 'rtx' extra) parses and builds on a CPU")
SLOTS, CHUNK_TOKENS = 8, 16


@pytest.fixture(scope="module")
def graphs(tiny_model, tmp_path_factory):
    """{groups: path} of the tiny model's slot decoder, one group and two."""
    tmp = tmp_path_factory.mktemp("slot-engine")
    one = export_slot_decoder(tiny_model, tmp / "decoder.slots.onnx", quiet=True)
    two = tmp / "decoder.slots.two.onnx"
    ir.save(two_group_decoder(ir.load(one)), two)
    return {1: one, 2: two}


def _network(path):
    logger = trt.Logger(trt.Logger.ERROR)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    assert parser.parse_from_file(str(path)), [parser.get_error(i).desc() for i in range(parser.num_errors)]
    return builder, network, parser


@pytest.mark.parametrize("groups", [1, 2])
def test_each_cache_is_one_kv_cache_update_whose_output_is_its_present(graphs, groups):
    _, network, _parser = _network(graphs[groups])
    layout = check_decoder_onnx(graphs[1])
    prefixes = ["", PREFIX][:groups]
    updates = {}
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type == trt.LayerType.KV_CACHE_UPDATE:
            out = layer.get_output(0)
            assert out.is_network_output, out.name
            updates[layer.get_input(0).name] = out.name
    # one layer per cache and group, each writing the present of the past it reads, which is the network input
    assert updates == {p + past: p + present for p in prefixes
                       for past, present in zip(layout.past_names, layout.present_names)}
    inputs = {network.get_input(i).name for i in range(network.num_inputs)}
    assert set(updates) <= inputs
    outputs = {network.get_output(i).name for i in range(network.num_outputs)}
    assert outputs == {p + n for p in prefixes for n in ["logits", *layout.present_names]}
    attention = [network.get_layer(i) for i in range(network.num_layers)
                 if network.get_layer(i).type == trt.LayerType.ATTENTION_OUTPUT]
    assert len(attention) == ANDREA_TINY.n_layer * groups
    for layer in attention:
        layer.__class__ = trt.IAttentionOutputLayer
        assert layer.attention.mask is not None and not layer.attention.causal  # the graph's mask, never is_causal


@pytest.mark.parametrize("groups", [1, 2])
def test_the_slot_engine_builds_with_in_flight_profiles(graphs, groups, tmp_path):
    """fp32 has no fused attention kernel: the build marks each IAttention decomposable, or it fails."""
    layout = check_decoder_onnx(graphs[1])
    profiles = slot_profiles(layout, SLOTS, CHUNK_TOKENS, two_groups=groups == 2)
    result = build_engine(graphs[groups], tmp_path / "slots.plan", builder="tensorrt-rtx", profiles=profiles,
                          opt_level=0, progress=False)
    assert (tmp_path / "slots.plan").stat().st_size == result.plan_bytes > 0
    assert [p["name"] for p in result.profiles] == ([DECODE, MIXED] if groups == 2 else [DECODE, CHUNK])


def test_slot_profiles_cover_every_input_with_a_static_cache(graphs):
    layout = check_decoder_onnx(graphs[1])
    decode, mixed = slot_profiles(layout, SLOTS, CHUNK_TOKENS)
    n, cache = layout.n_positions, [layout.n_head, layout.n_positions, layout.head_dim]
    assert decode["shapes"]["input_ids"] == {"min": [1, 1], "opt": [SLOTS, 1], "max": [SLOTS, 1]}
    assert decode["shapes"][PREFIX + "input_ids"]["max"] == [1, 1]  # a pad row beside the decode rows
    assert mixed["shapes"][PREFIX + "input_ids"] == {"min": [1, 1], "opt": [1, CHUNK_TOKENS], "max": [1, CHUNK_TOKENS]}
    for profile in (decode, mixed):
        assert profile["shapes"]["attention_mask"]["max"] == [SLOTS, n]
        assert profile["shapes"]["past_key_values.0.key"]["min"] == [1, *cache]
        assert profile["shapes"][PREFIX + "past_key_values.1.value"]["max"] == [1, *cache]
    for bad in ((0, 16), (257, 16), (8, 0), (8, n + 1)):
        with pytest.raises(ExportError, match="slot profiles"):
            slot_profiles(layout, *bad)


def test_a_build_with_max_slots_writes_the_slot_engine_and_its_graph(tmp_path):
    """`build --max-slots 4` (tiny, TensorRT-RTX): the two-group graph and its engine, with the decode and mixed
    profiles, recorded in the manifest as the table plans them; on a machine without a GPU the engine's check is
    a skip that says why, not a pass."""
    import json

    from andrea_export.catalog import Role, planned
    from andrea_export.pipeline import BuildOptions, run_build

    out = tmp_path / "slots"
    m = run_build(BuildOptions(config="andrea-tiny", builder="tensorrt-rtx", out=str(out), greedy_steps=2,
                               verify_shapes=[[1, 3]], max_slots=4))
    assert list(m["artifacts"]) == [r.value for r in planned("fp32", "tensorrt-rtx", slot_engine=True)
                                    if r.value in m["artifacts"]]
    assert {Role.SLOT_ENGINE_ONNX, Role.SLOT_ENGINE, Role.SLOT_ENGINE_INFO} <= set(m["artifacts"])
    info = json.loads((out / m["artifacts"][Role.SLOT_ENGINE]["path"]).with_suffix(".plan.json").read_text())
    assert [p["name"] for p in info["profiles"]] == [DECODE, MIXED]
    report = json.loads((out / "verify.json").read_text())
    assert any(s["artifact"] == Role.SLOT_ENGINE.value and "no GPU" in s["reason"] for s in report["skipped"])


def test_max_slots_with_a_tensorrt_older_than_10_15_is_refused_before_any_work(monkeypatch, tmp_path):
    import types

    from andrea_export import pipeline
    from andrea_export.engine import backends
    from andrea_export.errors import ConfigError

    monkeypatch.setattr(backends, "trt_module", lambda builder: types.SimpleNamespace(__version__="10.14.1.48"))
    with pytest.raises(ConfigError, match=r"TensorScatter.*10\.15.*this is TensorRT 10\.14\.1\.48"):
        pipeline._check_slot_engine_builder("tensorrt")
    pipeline._check_slot_engine_builder("tensorrt-rtx")  # RTX parses and builds it (the tests above)
    with pytest.raises(ConfigError, match="max_slots"):
        pipeline.BuildOptions(max_slots=257).check()
    with pytest.raises(ConfigError, match="needs the decoder"):
        pipeline.BuildOptions(max_slots=4, decoder=False).check()

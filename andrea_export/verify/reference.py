"""The PyTorch model an ONNX file must match, and the check that the file's inputs and outputs are that
model's (its metadata can be copied onto any graph; its signature cannot lie)."""

from __future__ import annotations

from pathlib import Path

from ..model.andrea import Andrea
from ..names import INPUT_IDS as INPUT_NAME
from ..names import LOGITS as OUTPUT_NAME


def reference_model_for(onnx_path: str | Path, checkpoint: str | Path | None = None, config=None) -> Andrea:
    """The PyTorch model an ONNX file must match: the given checkpoint, or the seeded random init that the
    file's metadata records. Refuses to guess when the file came from a checkpoint that is not given."""
    from ..errors import ConfigError
    from ..folder.reader import metadata_json
    from ..graphs.layout import check_onnx, config_of, metadata_of
    from ..model.checkpoint import model_for
    from ..names import CONFIG_KEY, WEIGHTS_KEY

    proto = check_onnx(onnx_path)  # once: its metadata and its signature come from this one load
    meta = metadata_of(proto)
    recorded = config_of(meta, onnx_path) if CONFIG_KEY in meta else None
    if config is not None and recorded is not None and config != recorded:
        differ = [f"{k} {v} vs {getattr(recorded, k)}" for k, v in config.to_dict().items() if v != getattr(recorded, k)]
        raise ConfigError(f"--config {config.name} does not match {onnx_path}, which was exported from {recorded.name} "
                          f"({'; '.join(differ)}); leave out --config: the file records its own")
    cfg = config or recorded
    source = metadata_json(meta, WEIGHTS_KEY, onnx_path) if WEIGHTS_KEY in meta else {}
    model = model_for(source, cfg, checkpoint, what=str(onnx_path))
    check_model_io(onnx_path, model.cfg, proto.graph)
    return model


def check_model_io(onnx_path: str | Path, cfg, graph=None) -> None:
    """Refuse, before anything runs, an ONNX file whose inputs and outputs are not the model's: one input
    input_ids int64 [batch, seq], one output logits float [batch, seq, vocab]. Metadata can be copied
    onto any graph; the graph's own signature cannot lie about what it takes. `graph`: the file's graph,
    when already loaded."""
    import onnx

    from ..errors import ExportError

    if graph is None:
        graph = onnx.load(str(onnx_path), load_external_data=False).graph
    init = {t.name for t in graph.initializer}
    sig = {"inputs": [(v.name, v.type.tensor_type.elem_type, len(v.type.tensor_type.shape.dim)) for v in graph.input
                      if v.name not in init],
           "outputs": [(v.name, v.type.tensor_type.elem_type, len(v.type.tensor_type.shape.dim)) for v in graph.output]}
    want_in = [(INPUT_NAME, onnx.TensorProto.INT64, 2)]
    out = graph.output[0].type.tensor_type.shape.dim if len(graph.output) == 1 else []
    vocab = out[-1].dim_value if len(out) == 3 else None
    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
    ok_out = (len(sig["outputs"]) == 1 and sig["outputs"][0][0] == OUTPUT_NAME and sig["outputs"][0][1] in floats
              and sig["outputs"][0][2] == 3 and vocab in (0, cfg.vocab_size))  # 0: a symbolic dimension
    if sig["inputs"] != want_in or not ok_out:
        def show(vals):
            return ", ".join(f"{n} {onnx.TensorProto.DataType.Name(t).lower()} rank {r}" for n, t, r in vals) or "none"

        raise ExportError(f"{onnx_path}: takes {show(sig['inputs'])} and gives {show(sig['outputs'])}; an "
                          f"{cfg.name} graph takes input_ids int64 [batch, seq] and gives logits [batch, seq, "
                          f"{cfg.vocab_size}]: not this model's graph (its metadata may be copied)")

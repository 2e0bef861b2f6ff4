"""What an exported graph says about itself, read without torch: a checked ONNX file, the model config and
metadata andrea-export recorded in it, and the KV-cache decoder's I/O layout. Runtimes and builders import
this; exporting (torch) lives in export.py and kvcache.py, which use it too.

The KV-cache decoder (one graph for both phases; only the shapes differ):

    inputs   input_ids                 int64   [batch, new_tokens]
             attention_mask            int64   [batch, past_len + new_tokens]   1 = real token, 0 = padding
             past_key_values.{i}.key   float32 [batch, n_head, past_len, head_dim]   i = 0 .. n_layer-1
             past_key_values.{i}.value float32 [batch, n_head, past_len, head_dim]
    outputs  logits                    float32 [batch, new_tokens, vocab_size]
             present.{i}.key           float32 [batch, n_head, past_len + new_tokens, head_dim]
             present.{i}.value         float32 [batch, n_head, past_len + new_tokens, head_dim]

The layout travels in the ONNX metadata as JSON under `andrea.kv_layout` (beside `andrea.config`), so a
runtime needs only the file (see kvcache.py for why one graph, and how it is exported).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import onnx

from ..config import ModelConfig
from ..errors import ExportError
from ..folder.reader import metadata_json
from ..names import ATTENTION_MASK, CONFIG_KEY, INPUT_IDS, KV_LAYOUT_KEY, LOGITS

LAYOUT_VERSION = 1

# Symbolic axis names, as written into the ONNX graph.
BATCH, NEW, PAST, TOTAL = "batch", "new_tokens", "past_len", "past_len + new_tokens"
# The in-place decoder's (inplace_decoder.py): the cache buffer's length; the mask's width (longest row).
CAPACITY, WIDTH = "capacity", "total"
# a past copied into a longer present each step; one buffer updated in place; the same at a fixed n_positions
CACHES = ("concat", "shared", "static")


def past_name(layer: int, kind: str) -> str:
    """`past_key_values.{layer}.{kind}`, kind 'key' or 'value'."""
    return f"past_key_values.{layer}.{kind}"


def present_name(layer: int, kind: str) -> str:
    """`present.{layer}.{kind}`, kind 'key' or 'value'."""
    return f"present.{layer}.{kind}"


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # numpy spelling: "int64", "float32"
    shape: tuple  # ints and symbolic axis names


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """The decoder graph's I/O for one model config; `to_dict()` is what goes into the ONNX metadata."""

    n_layer: int
    n_head: int
    head_dim: int
    vocab_size: int
    n_positions: int
    cache_dtype: str = "float32"
    cache: str = "concat"  # CACHES: "shared" is the in-place decoder (inplace_decoder.py), "static" the slot
    # decoder (slot_decoder.py), whose buffer is always n_positions long (TensorRT's KV-cache update wants it static)

    @classmethod
    def from_config(cls, cfg: ModelConfig, cache_dtype: str = "float32") -> KVLayout:
        return cls(cfg.n_layer, cfg.n_head, cfg.head_dim, cfg.vocab_size, cfg.n_positions, cache_dtype)

    @property
    def past_names(self) -> list[str]:
        return [past_name(i, k) for i in range(self.n_layer) for k in ("key", "value")]

    @property
    def present_names(self) -> list[str]:
        return [present_name(i, k) for i in range(self.n_layer) for k in ("key", "value")]

    @property
    def shared(self) -> bool:
        """past and present are one buffer per layer and kind, updated in place (inplace_decoder.py,
        slot_decoder.py): the same inputs and outputs, fed the same way."""
        return self.cache in ("shared", "static")

    @property
    def static(self) -> bool:
        """The in-place buffer is exactly n_positions long (slot_decoder.py)."""
        return self.cache == "static"

    @property
    def capacity(self) -> int | str:
        """The in-place buffer's length axis: n_positions when static, else symbolic."""
        return self.n_positions if self.static else CAPACITY

    @property
    def inputs(self) -> list[TensorSpec]:
        kv = (BATCH, self.n_head, self.capacity if self.shared else PAST, self.head_dim)
        mask = (BATCH, WIDTH if self.shared else TOTAL)
        return [TensorSpec(INPUT_IDS, "int64", (BATCH, NEW)), TensorSpec(ATTENTION_MASK, "int64", mask)] + [
            TensorSpec(n, self.cache_dtype, kv) for n in self.past_names
        ]

    @property
    def outputs(self) -> list[TensorSpec]:
        kv = (BATCH, self.n_head, self.capacity if self.shared else TOTAL, self.head_dim)
        return [TensorSpec(LOGITS, "float32", (BATCH, NEW, self.vocab_size))] + [
            TensorSpec(n, self.cache_dtype, kv) for n in self.present_names
        ]

    @property
    def feedback(self) -> dict[str, str]:
        """present output -> the past input it feeds at the next step."""
        return dict(zip(self.present_names, self.past_names))

    def to_dict(self) -> dict:
        if self.shared:  # written only for the in-place graph: a standard graph's record stays as it was
            return {**self._to_dict(), "cache": self.cache,
                    "attention_mask": "1 for each token a row holds (the new ones too), then 0 (pad on the right)",
                    "feedback": "present.* is past_key_values.* itself: bind both to one buffer"}
        return self._to_dict()

    def _to_dict(self) -> dict:
        return {
            "version": LAYOUT_VERSION,
            "n_layer": self.n_layer,
            "n_head": self.n_head,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "n_positions": self.n_positions,
            "cache_dtype": self.cache_dtype,
            "inputs": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in self.inputs],
            "outputs": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in self.outputs],
            "feedback": self.feedback,
            "attention_mask": "1 = real token, 0 = padding (pad on the left); covers past and new tokens",
            "positions": "derived in the graph: cumsum(attention_mask) - 1 over real tokens",
        }

    @classmethod
    def from_dict(cls, data: dict, source: str = "kv layout") -> KVLayout:
        if not isinstance(data, dict) or data.get("version") != LAYOUT_VERSION:
            version = data.get("version") if isinstance(data, dict) else None
            raise ExportError(f"{source}: unsupported KV layout version {version!r} (this toolkit reads {LAYOUT_VERSION})")
        fields = [f.name for f in dataclasses.fields(cls) if f.name != "cache"]
        try:
            layout = cls(**{f: data[f] for f in fields}, cache=data.get("cache", "concat"))
        except KeyError as e:
            raise ExportError(f"{source}: KV layout lacks the field {e.args[0]!r}") from None
        if layout.to_dict() != data:  # names/shapes recorded by another writer: refuse rather than guess
            raise ExportError(f"{source}: KV layout does not match the one this toolkit writes for its sizes")
        return layout


def kv_layout(cfg: ModelConfig) -> KVLayout:
    return KVLayout.from_config(cfg)


def check_onnx(path: str | Path) -> onnx.ModelProto:
    """Full onnx.checker check and strict shape inference of a file, and of where its external weights
    are (external_data.external_data_files); returns the model (weights not loaded)."""
    from .external_data import external_data_files

    path = Path(path)
    if not path.is_file():
        raise ExportError(f"{path}: no such ONNX file")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # a protobuf parse error has no public type
        raise ExportError(f"{path}: not an ONNX model ({type(e).__name__}: {e})") from None
    external_data_files(path, model)  # weights files: plain names beside it, one link, byte ranges inside them
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        raise ExportError(f"{path}: not a valid ONNX model: {str(e).splitlines()[0]}") from None
    return model


def read_metadata(path: str | Path) -> dict[str, str]:
    """The metadata_props of an ONNX file, checked to be a valid model first."""
    return metadata_of(check_onnx(path))


def read_config(path: str | Path) -> ModelConfig:
    """The ModelConfig an andrea-export ONNX file was exported from (its `andrea.config` metadata)."""
    return config_of(read_metadata(path), path)


def read_kv_layout(path: str | Path) -> KVLayout:
    """The layout recorded in a decoder ONNX file's metadata (`andrea.kv_layout`)."""
    return _layout(read_metadata(path), path)


def check_decoder_onnx(path: str | Path) -> KVLayout:
    """check_onnx, then: the graph's inputs and outputs are exactly the recorded layout (names, types, ranks,
    fixed sizes). Returns the layout."""
    return _check_decoder(check_onnx(path), path)


def read_decoder(path: str | Path) -> tuple[ModelConfig, KVLayout]:
    """(model config, checked KV layout) of a decoder graph, from one check of the file."""
    return read_decoder_meta(path)[:2]


def read_decoder_meta(path: str | Path) -> tuple[ModelConfig, KVLayout, dict[str, str]]:
    """(model config, checked KV layout, metadata) of a decoder graph, from one check of the file (a
    runtime's load, which also reads the recorded weight source)."""
    proto = check_onnx(path)
    layout = _check_decoder(proto, path)
    meta = metadata_of(proto)
    return config_of(meta, path), layout, meta


def metadata_of(proto: onnx.ModelProto) -> dict[str, str]:
    """The metadata_props of a loaded (checked) model."""
    return {p.key: p.value for p in proto.metadata_props}


def config_of(meta: dict[str, str], path) -> ModelConfig:
    """The ModelConfig recorded in a graph's metadata (`andrea.config`); `path` names the file in errors."""
    if CONFIG_KEY not in meta:
        raise ExportError(
            f"{path}: has no '{CONFIG_KEY}' metadata: not exported by andrea-export, so its model config is unknown"
        )
    return ModelConfig.from_dict(metadata_json(meta, CONFIG_KEY, path), source=f"{path} metadata '{CONFIG_KEY}'")


def _layout(meta: dict[str, str], path) -> KVLayout:
    if KV_LAYOUT_KEY not in meta:
        raise ExportError(
            f"{path}: has no '{KV_LAYOUT_KEY}' metadata: not a KV-cache decoder graph "
            f"(export one with andrea_export.graphs.kvcache.export_decoder_onnx)"
        )
    return KVLayout.from_dict(metadata_json(meta, KV_LAYOUT_KEY, path), source=f"{path} metadata")


def _check_decoder(proto: onnx.ModelProto, path) -> KVLayout:
    layout = _layout(metadata_of(proto), path)
    for kind, got, want in (("input", proto.graph.input, layout.inputs), ("output", proto.graph.output, layout.outputs)):
        got_names = [v.name for v in got]
        if got_names != [t.name for t in want]:
            raise ExportError(f"{path}: graph {kind}s {got_names} differ from the KV layout's {[t.name for t in want]}")
        for v, t in zip(got, want):
            tt = v.type.tensor_type
            dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type).name
            dims = tuple(d.dim_param if d.HasField("dim_param") else d.dim_value for d in tt.shape.dim)
            if dtype != t.dtype or dims != t.shape:
                raise ExportError(f"{path}: {kind} '{v.name}' is {dtype}{list(dims)}, the KV layout says {t.dtype}{list(t.shape)}")
    return layout

"""The build folder described once: every artifact a build can write, by role, with its file name, precision,
kind, what it is built from and who reads it.

The stages write files; the pipeline records each under its role here (`Artifacts.add`, which refuses a file
the table does not name for that role), and every reader (verify, runtime, deploy, inspect) asks the table
instead of probing keys or file names: `engine_source` is "the graph this engine is built from",
`decoder_graph` "the decoder graph this backend runs". A role's value is its key in manifest.json's
"artifacts", so the folder's format is the table's, and a role spelled anywhere else is a bug
(tests/test_catalog.py looks for one).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

from .names import (DECODER_FILE, EVAL_TEXT_FILE, INPLACE_DECODER_FILE, PRECISIONS, SLOT_DECODER_FILE,
                    TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, WEIGHT_ONLY, WEIGHTS_FILE)


class Role(enum.StrEnum):
    """An artifact's key in manifest.json's "artifacts" (the values are the folder's format: never rename one)."""

    ONNX = "onnx"
    ONNX_FP32 = "onnx_fp32"
    ONNX_QDQ = "onnx_qdq"
    ONNX_PLUGIN = "onnx_plugin"
    DECODER_ONNX = "decoder_onnx"
    DECODER_ONNX_FP32 = "decoder_onnx_fp32"
    DECODER_ONNX_INPLACE = "decoder_onnx_inplace"
    DECODER_ONNX_SLOTS = "decoder_onnx_slots"
    SLOT_ENGINE_ONNX = "slot_engine_onnx"
    DECODER_ONNX_QDQ = "decoder_onnx_qdq"
    DECODER_ONNX_PLUGIN = "decoder_onnx_plugin"
    GENAI_CONFIG = "genai_config"
    WEIGHTS = "weights"
    WEIGHTS_FP32 = "weights_fp32"
    TOKENIZER = "tokenizer"
    TOKENIZER_CONFIG = "tokenizer_config"
    EVAL_TEXT = "eval_text"
    ENGINE = "engine"
    ENGINE_INFO = "engine_info"
    LAYER_REPORT = "layer_report"
    DECODER_ENGINE = "decoder_engine"
    DECODER_ENGINE_INFO = "decoder_engine_info"
    DECODER_LAYER_REPORT = "decoder_layer_report"
    SLOT_ENGINE = "slot_engine"
    SLOT_ENGINE_INFO = "slot_engine_info"
    SLOT_LAYER_REPORT = "slot_layer_report"
    VERIFY_REPORT = "verify_report"


class Kind(enum.StrEnum):
    GRAPH = "graph"  # ONNX
    WEIGHTS = "weights"  # ONNX external data, shared by the graphs of one precision
    ENGINE = "engine"  # a serialized TensorRT / TensorRT-RTX plan
    SIDECAR = "sidecar"  # JSON beside an engine: what built it, its layers
    TEXT = "text"  # tokenizer files, the evaluation text
    CONFIG = "config"  # a runtime's configuration (onnxruntime-genai)
    REPORT = "report"  # the verification report


@dataclasses.dataclass(frozen=True)
class Artifact:
    """One row of the table. `file` is a template: {stem} is "" for fp32 and ".<precision>" otherwise, {qdq} is
    ".qdq" for the weight-only precisions (whose engine graphs are the Q/DQ form). `fp32`: the artifact is float32
    whatever the build's precision (the sources a lower precision is converted from). `built_from`: the roles it
    is made from, `read_by`: who reads it besides `verify` and `inspect`, which read everything."""

    role: Role
    kind: Kind
    file: str
    what: str
    built_from: tuple[Role, ...] = ()
    read_by: tuple[str, ...] = ()
    fp32: bool = False

    def file_name(self, precision: str) -> str:
        """The file's name in a build of `precision`."""
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}")
        return self.file.format(stem="" if precision == "fp32" else f".{precision}",
                                qdq=".qdq" if precision in WEIGHT_ONLY else "", precision=precision)

    def precision(self, build_precision: str) -> str:
        """The precision of this artifact's weights in a build of `build_precision`."""
        return "fp32" if self.fp32 else build_precision


R = Role
_ROWS = (
    Artifact(R.ONNX, Kind.GRAPH, "model{stem}.onnx", "the standard graph: input_ids -> logits, every tanh-GELU one "
             "Gelu node; an int8/int4 build's weights are MatMulNBits", (R.ONNX_FP32,), ("onnxruntime", "openvino",
             "triton", "tensorrt-rtx")),
    Artifact(R.ONNX_FP32, Kind.GRAPH, "model.onnx", "the float32 standard graph a lower precision is converted from",
             (), ("verify",), fp32=True),
    Artifact(R.ONNX_QDQ, Kind.GRAPH, "model{stem}.qdq.onnx", "the weight-only graph as DequantizeLinear of its "
             "weights: what TensorRT imports", (R.ONNX_FP32,), ("tensorrt", "tensorrt-rtx")),
    Artifact(R.ONNX_PLUGIN, Kind.GRAPH, "model{stem}{qdq}.plugin.onnx", "the engine's graph with every tanh-GELU a "
             "call of andrea.TanhGelu (TensorRT imports our plugin, ONNX Runtime runs the body)", (R.ONNX, R.ONNX_QDQ),
             ("tensorrt", "triton")),
    Artifact(R.DECODER_ONNX, Kind.GRAPH, DECODER_FILE.replace(".onnx", "{stem}.onnx"), "the KV-cache decoder",
             (R.DECODER_ONNX_FP32,), ("runtime", "openvino", "triton", "tensorrt-rtx")),
    Artifact(R.DECODER_ONNX_FP32, Kind.GRAPH, DECODER_FILE, "the float32 decoder a lower precision is converted "
             "from", (), ("verify",), fp32=True),
    Artifact(R.DECODER_ONNX_INPLACE, Kind.GRAPH, INPLACE_DECODER_FILE.replace(".inplace", "{stem}.inplace"),
             "the decoder with its cache updated in place (GroupQueryAttention)", (), ("onnxruntime", "genai",
             "triton-generate", "serve")),
    Artifact(R.DECODER_ONNX_SLOTS, Kind.GRAPH, SLOT_DECODER_FILE.replace(".slots", "{stem}{qdq}.slots"),
             "the decoder for in-flight batching on TensorRT >= 10.15: a static slot cache updated in place by "
             "TensorScatter, standard Attention (an int8/int4 build's weights as DequantizeLinear)", (),
             ("tensorrt",)),
    Artifact(R.SLOT_ENGINE_ONNX, Kind.GRAPH, SLOT_DECODER_FILE.replace(".slots", "{stem}{qdq}.slots.two"),
             "the slot decoder with a second group of inputs (graphs/two_groups.py: a prompt's chunk beside the "
             "decoding rows, each weight read once for both): the slot engine's graph", (R.DECODER_ONNX_SLOTS,),
             ("tensorrt",)),
    Artifact(R.DECODER_ONNX_QDQ, Kind.GRAPH, DECODER_FILE.replace(".onnx", "{stem}.qdq.onnx"), "the weight-only "
             "decoder as DequantizeLinear of its weights", (R.DECODER_ONNX_FP32,), ("tensorrt", "tensorrt-rtx")),
    Artifact(R.DECODER_ONNX_PLUGIN, Kind.GRAPH, DECODER_FILE.replace(".onnx", "{stem}{qdq}.plugin.onnx"),
             "the decoder engine's graph with the plugin calls", (R.DECODER_ONNX, R.DECODER_ONNX_QDQ), ("tensorrt",)),
    Artifact(R.GENAI_CONFIG, Kind.CONFIG, "genai_config.json", "what onnxruntime_genai.Model(build) runs",
             (R.DECODER_ONNX_INPLACE, R.DECODER_ONNX), ("genai",)),
    Artifact(R.WEIGHTS, Kind.WEIGHTS, WEIGHTS_FILE.format("{precision}"), "every weight of the build's graphs, once",
             (), ("every graph of the build's precision",)),
    Artifact(R.WEIGHTS_FP32, Kind.WEIGHTS, WEIGHTS_FILE.format("fp32"), "the float32 sources' weights",
             (), ("the fp32 graphs",), fp32=True),
    Artifact(R.TOKENIZER, Kind.TEXT, TOKENIZER_FILE, "the tokenizer (build --tokenizer)", (),
             ("runtime", "genai", "optimum", "triton-generate")),
    Artifact(R.TOKENIZER_CONFIG, Kind.TEXT, TOKENIZER_CONFIG_FILE, "how transformers and genai load it",
             (R.TOKENIZER,), ("genai", "optimum", "triton-generate")),
    Artifact(R.EVAL_TEXT, Kind.TEXT, EVAL_TEXT_FILE, "the evaluation text (build --eval-text)", (), ("verify",)),
    Artifact(R.ENGINE, Kind.ENGINE, "model.plan", "the stateless engine", (R.ONNX_PLUGIN, R.ONNX, R.ONNX_QDQ),
             ("triton", "bench")),
    Artifact(R.ENGINE_INFO, Kind.SIDECAR, "model.plan.json", "what built the engine, for what, from what",
             (R.ENGINE,), ("runtime", "triton")),
    Artifact(R.LAYER_REPORT, Kind.SIDECAR, "model.layers.json", "the engine's layers", (R.ENGINE,), ()),
    Artifact(R.DECODER_ENGINE, Kind.ENGINE, "decoder.plan", "the decoder engine (prefill and decode profiles)",
             (R.DECODER_ONNX_PLUGIN, R.DECODER_ONNX, R.DECODER_ONNX_QDQ), ("tensorrt", "triton")),
    Artifact(R.DECODER_ENGINE_INFO, Kind.SIDECAR, "decoder.plan.json", "what built the decoder engine",
             (R.DECODER_ENGINE,), ("runtime", "triton")),
    Artifact(R.DECODER_LAYER_REPORT, Kind.SIDECAR, "decoder.layers.json", "the decoder engine's layers",
             (R.DECODER_ENGINE,), ()),
    Artifact(R.SLOT_ENGINE, Kind.ENGINE, "decoder.slots.plan", "the in-flight batching engine (profiles: decode "
             "rows, and a prompt's chunk beside them; TensorRT >= 10.15)", (R.SLOT_ENGINE_ONNX,), ("tensorrt", "serve")),
    Artifact(R.SLOT_ENGINE_INFO, Kind.SIDECAR, "decoder.slots.plan.json", "what built the slot engine",
             (R.SLOT_ENGINE,), ("runtime",)),
    Artifact(R.SLOT_LAYER_REPORT, Kind.SIDECAR, "decoder.slots.layers.json", "the slot engine's layers",
             (R.SLOT_ENGINE,), ()),
    Artifact(R.VERIFY_REPORT, Kind.REPORT, "verify.json", "Polygraphy's verdict per artifact", (), ("inspect",)),
)
TABLE: Mapping[Role, Artifact] = {a.role: a for a in _ROWS}
_VALUES = {r.value for r in Role}
ENGINES = (R.ENGINE, R.DECODER_ENGINE, R.SLOT_ENGINE)
SIDECARS = {R.ENGINE: (R.ENGINE_INFO, R.LAYER_REPORT), R.DECODER_ENGINE: (R.DECODER_ENGINE_INFO, R.DECODER_LAYER_REPORT),
            R.SLOT_ENGINE: (R.SLOT_ENGINE_INFO, R.SLOT_LAYER_REPORT)}


def engine_source(engine: Role, builder: str, precision: str) -> Role:
    """The graph `engine` (Role.ENGINE or Role.DECODER_ENGINE) is built from. TensorRT builds the plugin graphs
    (our kernel in the engine); TensorRT-RTX, which has no plugin layers, the standard ones (native GELU); the
    weight-only precisions give both their Q/DQ form (TensorRT imports no MatMulNBits). The slot engine is
    built from its two-group graph by either builder (standard ops, native GELU: no plugin form of it yet)."""
    decoder = engine == R.DECODER_ENGINE
    if engine not in ENGINES:
        raise ValueError(f"{engine!r} is not an engine")
    if engine == R.SLOT_ENGINE:
        return R.SLOT_ENGINE_ONNX
    if builder == "tensorrt":
        return R.DECODER_ONNX_PLUGIN if decoder else R.ONNX_PLUGIN
    if precision in WEIGHT_ONLY:
        return R.DECODER_ONNX_QDQ if decoder else R.ONNX_QDQ
    return R.DECODER_ONNX if decoder else R.ONNX


def plugin_source(plugin: Role, precision: str) -> Role:
    """The graph a plugin graph (Role.ONNX_PLUGIN or Role.DECODER_ONNX_PLUGIN) is made from: the engine's."""
    return engine_source(R.DECODER_ENGINE if plugin == R.DECODER_ONNX_PLUGIN else R.ENGINE, "tensorrt-rtx", precision)


def decoder_graph(backend: str, have: Iterable[str]) -> Role:
    """The decoder graph a runtime backend runs, of the roles a folder `have`s: ONNX Runtime on the CPU runs the
    in-place decoder where there is one (its CUDA provider has no float32 GroupQueryAttention); everything else,
    and every reader of the model config and cache layout, the standard decoder."""
    return R.DECODER_ONNX_INPLACE if backend == "onnxruntime" and R.DECODER_ONNX_INPLACE in set(have) else R.DECODER_ONNX


def planned(precision: str, builder: str, *, decoder: bool = True, tokenizer: bool = False,
            eval_text: bool = False, slot_engine: bool = False) -> tuple[Role, ...]:
    """The roles a build with these options writes (the layer reports only where the builder writes one),
    in the order the pipeline makes them; `slot_engine`: the in-flight batching engine too (decoder builds)."""
    slot_engine = slot_engine and decoder
    lower, weight_only = precision != "fp32", precision in WEIGHT_ONLY
    roles = [R.ONNX, *[R.ONNX_FP32] * lower, *[R.ONNX_QDQ] * weight_only, R.ONNX_PLUGIN]
    if decoder:
        roles += [R.DECODER_ONNX, *[R.DECODER_ONNX_FP32] * lower, *[R.DECODER_ONNX_INPLACE] * (precision != "bf16"),
                  R.DECODER_ONNX_SLOTS, *[R.SLOT_ENGINE_ONNX] * slot_engine, R.GENAI_CONFIG, *[R.DECODER_ONNX_QDQ] * weight_only, *[R.DECODER_ONNX_PLUGIN] * (builder == "tensorrt")]
    roles += [R.WEIGHTS, *[R.WEIGHTS_FP32] * lower, *[R.TOKENIZER, R.TOKENIZER_CONFIG] * tokenizer,
              *[R.EVAL_TEXT] * eval_text, R.ENGINE, R.ENGINE_INFO, R.LAYER_REPORT]
    if decoder:
        roles += [R.DECODER_ENGINE, R.DECODER_ENGINE_INFO, R.DECODER_LAYER_REPORT]
    if slot_engine:
        roles += [R.SLOT_ENGINE, R.SLOT_ENGINE_INFO, R.SLOT_LAYER_REPORT]
    return (*roles, R.VERIFY_REPORT)


class Artifacts(Mapping[Role, str]):
    """The artifacts of one build folder (staged or finished): role -> file name in the folder, each name the
    one the table gives the role in a build of `precision`."""

    def __init__(self, folder: str | Path, precision: str, names: Mapping[str, str] | None = None):
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}")
        self.folder, self.precision = Path(folder), precision
        self._names: dict[Role, str] = {}
        for role, name in (names or {}).items():
            self.add(Role(role), name)

    @classmethod
    def of_manifest(cls, folder: str | Path, manifest: Mapping) -> "Artifacts":
        """The artifacts a validated manifest records (folder/reader.py has checked that every path stays in the
        folder); a role this andrea-export does not know is left out. The names are the manifest's, not checked
        against the table: the sha256 it records, checked by whoever reads a file, is what binds them."""
        made = cls(folder, manifest["precision"])
        made._names = {Role(r): a["path"] for r, a in manifest["artifacts"].items() if r in _VALUES}
        return made

    def add(self, role: Role, path: str | Path) -> Path:
        """Record the file written for `role` (a path in the folder, or its name); returns its path."""
        name = Path(path).name
        want = TABLE[role].file_name(self.precision)
        if name != want:
            raise ValueError(f"artifact {role.value!r} of a {self.precision} build is {want!r}, not {name!r}")
        self._names[role] = name
        return self.folder / name

    def path(self, role: Role) -> Path:
        return self.folder / self._names[role]

    def get_path(self, role: Role) -> Path | None:
        return self.folder / self._names[role] if role in self._names else None

    def precision_of(self, role: Role) -> str:
        return TABLE[role].precision(self.precision)

    def graphs_by_precision(self) -> dict[str, list[Path]]:
        """The graphs of the folder grouped by the precision of their weights (one shared weights file each)."""
        out: dict[str, list[Path]] = {}
        for role, name in self._names.items():
            if TABLE[role].kind == Kind.GRAPH:
                out.setdefault(self.precision_of(role), []).append(self.folder / name)
        return out

    def __getitem__(self, role: Role) -> str:
        return self._names[role]

    def __iter__(self) -> Iterator[Role]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __repr__(self) -> str:
        return f"Artifacts({str(self.folder)!r}, {self.precision!r}, {dict(self._names)!r})"


def weights_role(precision: str, build_precision: str) -> Role:
    """The shared weights file of the graphs of `precision` in a build of `build_precision`."""
    return R.WEIGHTS if precision == build_precision else R.WEIGHTS_FP32


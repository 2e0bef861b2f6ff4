"""The weights once per build folder: several ONNX graphs pointing into ONE external-data file.

The standard graph, the plugin graph and the KV-cache decoder of one precision hold the same tensors
(the decoder's are the model's, under other names where the exporter folded a transpose: matched by
content, not by name). `share_weights` writes each distinct tensor once into one file and rewrites every
graph's initializers as ONNX external-data references (`location`, `offset`, `length`) into it, so a
folder costs about the weights, not three copies of them. Every ONNX consumer reads this standard form
from the graph's path: ONNX Runtime, the TensorRT / TensorRT-RTX parser (`parse_from_file`), Polygraphy,
onnx.load, onnx-ir; a graph loaded from bytes instead of its path cannot find its weights.

`location` is read from a file that may come from anywhere (a build folder is untrusted), so
`external_data_files` is the check our readers apply before any reader opens it: a plain file name in
the graph's own folder, a regular file (no symlink: TensorRT's parser follows one out of the folder)
with one link (onnx.load and onnx-ir refuse more: a hard link may lead anywhere), every byte range
inside it. onnx.load and ONNX Runtime refuse `..` and absolute paths themselves.

Layout of the file: tensors in first-seen order, each starting on a 64-byte boundary (4 KiB for those
over 1 MiB, so a reader can memory-map them in place); padding is zeros.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import onnx

from ..errors import AndreaExportError, BuildError, ExportError
from ..folder.atomic import atomic_path
from ..folder.reader import changed_artifacts

MIN_BYTES = 64  # smaller initializers (scalars, shape constants) stay inside the graph
_ALIGN, _PAGE, _PAGE_ABOVE = 64, 4096, 1 << 20


@dataclasses.dataclass
class SharedWeights:
    """What share_weights did. `referenced_bytes` is what the graphs would hold without sharing."""

    path: Path
    graphs: list[Path]
    references: int  # initializers now pointing into the file
    tensors: int  # distinct byte ranges written
    bytes: int  # size of the file
    referenced_bytes: int

    def summary(self) -> str:
        return (f"{self.path.name}: {self.tensors} tensors, {self.bytes / 1e6:,.1f} MB, shared by "
                f"{len(self.graphs)} graph(s) ({self.references} initializers; "
                f"{self.referenced_bytes / 1e6:,.1f} MB if each held its own)")


def share_weights(graphs: Sequence[str | Path], data_file: str | Path, *, min_bytes: int = MIN_BYTES) -> SharedWeights:
    """Store the initializers of `graphs` once, in `data_file`, and point every graph into it.

    The graphs (inline weights or external data) and `data_file` must be in one folder. Tensors with the
    same bytes share one range, whatever their names. Every file is written under a temporary name and
    renamed when complete (the data file first, so a graph never points into a missing file); a graph's
    own former data file (`<graph>.data`, as andrea-export writes it) is removed afterwards.
    """
    import onnx_ir as ir

    data_file = Path(data_file)
    folder = data_file.parent
    paths = [Path(g) for g in graphs]
    for g in paths:
        if g.parent.resolve() != folder.resolve():
            raise ExportError(f"{g}: must be in the folder of its weights file {data_file}")
        external_data_files(g)  # a graph pointing outside its folder is refused before anything is read
    index: dict[bytes, tuple[int, int]] = {}  # sha256 -> (offset, length)
    references = referenced = 0
    staged: list[tuple[Path, onnx.ModelProto]] = []
    with atomic_path(data_file) as tmp_data, open(tmp_data, "wb") as out:
        for g in paths:
            model = ir.load(g)  # external weights are memory-mapped, not read
            for graph in model.graphs():
                for value in graph.initializers.values():
                    tensor = value.const_value
                    if tensor is None or tensor.nbytes < min_bytes:
                        if isinstance(tensor, ir.ExternalTensor):  # its old file goes away: keep it inline
                            value.const_value = ir.Tensor(tensor.numpy(), name=tensor.name)
                        continue
                    raw = tensor.tobytes()
                    key = hashlib.sha256(raw).digest()
                    if key not in index:
                        offset = _aligned(out.tell(), len(raw))
                        out.write(b"\0" * (offset - out.tell()))
                        out.write(raw)
                        index[key] = (offset, len(raw))
                    offset, length = index[key]
                    value.const_value = ir.ExternalTensor(
                        data_file.name, offset, length, tensor.dtype, shape=ir.Shape(tensor.shape.numpy()),
                        name=value.name or "", doc_string=tensor.doc_string, base_dir=folder)
                    references += 1
                    referenced += length
            staged.append((g, ir.serde.serialize_model(model)))
            del model
        out.flush()
        os.fsync(out.fileno())
        size = out.tell()
    # data_file is complete and in place; now each graph, then the files nothing points to any more
    for g, proto in staged:
        with atomic_path(g) as tmp:
            onnx.save(proto, str(tmp))
    for g in paths:
        old = folder / (g.name + ".data")
        if old.name != data_file.name:
            old.unlink(missing_ok=True)
    return SharedWeights(path=data_file, graphs=paths, references=references, tensors=len(index), bytes=size,
                         referenced_bytes=referenced)


def _aligned(offset: int, length: int) -> int:
    step = _PAGE if length > _PAGE_ABOVE else _ALIGN
    return -(-offset // step) * step


def external_data_files(path: str | Path, model: onnx.ModelProto | None = None) -> dict[str, int]:
    """{file name: size} of the external-data files the ONNX file `path` points into ({} when it holds
    its weights itself), after checking that each `location` is a plain file name of a regular file
    (not a symlink) beside it, and that every tensor's byte range lies inside its file. Raises
    ExportError naming the tensor otherwise. `model`: the file's proto when already loaded (without
    external data)."""
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    path = Path(path)
    if model is None:
        try:
            model = onnx.load(str(path), load_external_data=False)
        except Exception as e:  # protobuf parse errors have no public type
            raise ExportError(f"{path}: not an ONNX model ({type(e).__name__}: {e})") from None
    sizes: dict[str, int] = {}
    for t in _tensors(model):
        if not uses_external_data(t):
            continue
        try:
            info = ExternalDataInfo(t)  # parses offset and length with int(): "abc" and "-5" raise ValueError
        except ValueError as e:
            raise ExportError(f"{path}: tensor '{t.name}' has external data that is not a byte range ({e}); the "
                              "graph was not written by an ONNX exporter") from None
        loc = info.location
        if not loc or loc in (".", "..") or "/" in loc or "\\" in loc or ":" in loc:
            raise ExportError(f"{path}: tensor '{t.name}' points to external data '{loc}', which is not a plain file "
                              "name beside the graph; refusing to read it")
        if loc not in sizes:
            f = path.parent / loc
            if f.is_symlink() or not f.is_file():
                raise ExportError(f"{path}: the weights file '{loc}' of tensor '{t.name}' is "
                                  f"{'a symbolic link' if f.is_symlink() else 'missing'} beside the graph")
            st = f.stat()
            if st.st_nlink > 1:  # as onnx.load and onnx-ir, which refuse it: a link may lead to any file
                raise ExportError(f"{path}: the weights file '{loc}' has {st.st_nlink} hard links, which onnx "
                                  "refuses (a hard-link attack guard); give the folder its own copy")
            sizes[loc] = st.st_size
        offset = int(info.offset or 0)
        length = int(info.length) if info.length is not None else sizes[loc] - offset
        if offset < 0 or length < 0 or offset + length > sizes[loc]:
            raise ExportError(f"{path}: tensor '{t.name}' reads bytes {offset}..{offset + length} of '{loc}', "
                              f"which has {sizes[loc]}: the graph and its weights file do not belong together")
    return sizes


def _tensors(model: onnx.ModelProto):
    """Every TensorProto of the model that may hold data: initializers and tensor attributes, subgraphs too."""

    def graph_tensors(g: onnx.GraphProto):
        yield from g.initializer
        for node in g.node:
            for a in node.attribute:
                if a.type == onnx.AttributeProto.TENSOR:
                    yield a.t
                elif a.type == onnx.AttributeProto.GRAPH:
                    yield from graph_tensors(a.g)
                elif a.type == onnx.AttributeProto.GRAPHS:
                    for sub in a.graphs:
                        yield from graph_tensors(sub)

    yield from graph_tensors(model.graph)
    for f in model.functions:
        for node in f.node:
            for a in node.attribute:
                if a.type == onnx.AttributeProto.TENSOR:
                    yield a.t


def graph_weights(folder: str | Path, manifest: dict, graph: str | Path, error: type[Exception] = BuildError) -> list[str]:
    """The weights files `graph` points into (ONNX external data), each a recorded artifact of the validated
    `manifest` that still matches its sha256: whoever runs or ships a graph runs or ships those bytes too."""
    try:
        names = sorted(external_data_files(graph))
    except AndreaExportError as e:
        raise error(str(e)) from None
    recorded = {a["path"]: (r, a) for r, a in manifest["artifacts"].items()}
    if missing := [w for w in names if w not in recorded]:
        raise error(f"{folder}: {Path(graph).name} points into {', '.join(missing)}, which the manifest does not record; rebuild it")
    if changed := changed_artifacts(folder, {"artifacts": dict(recorded[w] for w in names)}):
        raise error(f"{folder}: {', '.join(changed)} changed since the build (sha256 differs); rebuild it")
    return names


def check_folder_weights(folder: str | Path, manifest: dict, error: type[Exception] = BuildError) -> None:
    """Every ONNX graph the validated `manifest` records points only into weights files it records, each a
    plain regular file with one link beside the graph (external_data_files). For a caller that has checked
    every artifact's sha256 already (changed_artifacts): nothing is hashed a second time."""
    recorded = {a["path"] for a in manifest["artifacts"].values()}
    for a in manifest["artifacts"].values():
        if not a["path"].endswith(".onnx"):
            continue
        try:
            names = sorted(external_data_files(Path(folder) / a["path"]))
        except AndreaExportError as e:
            raise error(str(e)) from None
        if missing := [w for w in names if w not in recorded]:
            raise error(f"{folder}: {a['path']} points into {', '.join(missing)}, which the manifest does not "
                        "record; rebuild it")

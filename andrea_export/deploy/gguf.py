"""A GGUF file that llama.cpp (llama-cli, llama-server, Ollama, LM Studio) loads as it is, written from a build
folder with ggml's own `gguf` package: architecture gpt2, the build's float32 weights in the tensor names and
layouts llama.cpp's gpt2 loader asks for (`src/models/gpt2.cpp`), its tokenizer as llama.cpp's GPT-2 BPE
vocabulary (pre-tokenizer "gpt-2"), the context length, and the end-of-text token.

The weights come from the build's float32 standard graph (model.onnx, which every build has, checked against
the manifest): its exporter names only some initializers, so they are found by the graph's structure, each
checked for the shape its place in the model has. The tied head needs no tensor of its own: llama.cpp's gpt2
loader reads the token embedding for the output when `output.weight` is absent.

Types (`GGUF_TYPES`): f32, f16 and bf16 for every matrix; q8_0, q5_0, q5_1, q4_0 and q4_1, ggml's block
formats (blocks of 32 along each row), quantized by gguf's numpy code, the same arithmetic as ggml's reference
quantizers. Vectors (norms, biases) stay f32, as llama.cpp's converter keeps them. At 4 and 5 bits the token
embedding, which is also the output projection, is written q8_0: llama-quantize keeps that tensor at 6 bits
(Q6_K, which gguf cannot write), since most of a 4-bit model's error is there.

At q4_0 the linear layers' blocks are not rounded but solved by GPTQ (`q4_0_blocks`), as the build's int4 is:
each layer's error weighed by its input's second moment over seeded random ids on the fp32 graph
(graphs/quantize.weight_moments), in Q4_0's own grid (scale = the block's largest-magnitude value / -8, float16),
so llama.cpp reads the file as any Q4_0. On ANDREA-120M's seeded weights, run by llama.cpp: next-token KL from
fp32 0.0029 against llama-quantize's Q4_0's 0.0081 (benchmarks/README.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..errors import AndreaExportError, PackageError, require

ARCH = "gpt2"
# --gguf-type -> (tensor type name in gguf.GGMLQuantizationType, file type name in gguf.LlamaFileType)
GGUF_TYPES = {"f32": ("F32", "ALL_F32"), "f16": ("F16", "MOSTLY_F16"), "bf16": ("BF16", "MOSTLY_BF16"),
              "q8_0": ("Q8_0", "MOSTLY_Q8_0"), "q5_1": ("Q5_1", "MOSTLY_Q5_1"), "q5_0": ("Q5_0", "MOSTLY_Q5_0"),
              "q4_1": ("Q4_1", "MOSTLY_Q4_1"), "q4_0": ("Q4_0", "MOSTLY_Q4_0")}
LOW_BITS = ("q5_1", "q5_0", "q4_1", "q4_0")  # whose token embedding (the tied head) is written q8_0
GGML_BLOCK = 32  # the row block of every quantized type here
GPTQ_TYPES = ("q4_0",)  # whose linear layers' integers GPTQ chooses (q4_0_blocks), not rounding
# The type a build's GGUF gets unless told: its own precision's (an int4 build's user expects int4's bytes, not
# f16's four times as many); float32 builds f16, llama.cpp's usual float.
TYPE_OF_PRECISION = {"fp32": "f16", "fp16": "f16", "bf16": "bf16", "int8": "q8_0", "int4": "q4_0"}


def write_gguf(build_dir: str | Path, out: str | Path, gguf_type: str | None = None, *, overwrite: bool = False,
               allow_failed: bool = False) -> Path:
    """Write `out`, a GGUF llama.cpp loads, from the build folder `build_dir` (under its shared lock, every
    file it reads checked against the manifest). `gguf_type`: one of GGUF_TYPES; None: the build's precision's
    (TYPE_OF_PRECISION). Written atomically: an interrupted write leaves no file, or the old one. Returns `out`."""
    from ..catalog import Role
    from ..folder.atomic import locked_folder
    from ..graphs.external_data import graph_weights
    from ..graphs.layout import check_onnx, config_of, metadata_of
    from ..names import PRECISION_KEY
    from .triton.common import artifact_file, check_status, read_manifest

    require("gguf", "gguf", "Writing a GGUF file")
    if gguf_type is not None and gguf_type not in GGUF_TYPES:
        raise PackageError(f"GGUF type must be one of {', '.join(GGUF_TYPES)}, got {gguf_type!r}")
    build_dir, out = Path(build_dir), Path(out)
    _check_out(build_dir, out, overwrite)
    with locked_folder(build_dir, shared=True):
        manifest = read_manifest(build_dir)
        check_status(build_dir, manifest, allow_failed, "a GGUF file")
        role = Role.ONNX_FP32 if Role.ONNX_FP32 in manifest["artifacts"] else Role.ONNX  # fp32 builds: one graph
        if role not in manifest["artifacts"]:
            raise PackageError(f"{build_dir}: no float32 standard graph ('{Role.ONNX}') to take the weights from")
        graph = artifact_file(build_dir, manifest, role)
        graph_weights(build_dir, manifest, graph, PackageError)
        try:
            meta = metadata_of(check_onnx(graph))
            cfg = config_of(meta, graph)
        except AndreaExportError as e:
            raise PackageError(str(e)) from None
        if meta.get(PRECISION_KEY, "fp32") != "fp32":
            raise PackageError(f"{graph}: a {meta[PRECISION_KEY]} graph where the build's float32 one should be")
        return write_gguf_of_graph(graph, cfg, out, gguf_type or TYPE_OF_PRECISION[manifest["precision"]],
                                   gpt2_vocab(build_dir, cfg.vocab_size))


def write_gguf_of_graph(graph: Path, cfg, out: Path, gguf_type: str, vocab: dict | None = None) -> Path:
    """`out` from the float32 standard graph `graph` of model `cfg` (its weights beside it, already checked by the
    caller), with `vocab` (gpt2_vocab) or none; written atomically."""
    from ..folder.atomic import atomic_path

    gguf = require("gguf", "gguf", "Writing a GGUF file")
    tensors = gpt2_tensors(_load(graph), cfg)
    if gguf_type in GPTQ_TYPES:
        from ..graphs.quantize import weight_moments

        moments = weight_moments(graph)
    else:
        moments = {}
    with atomic_path(out) as tmp:
        writer = gguf.GGUFWriter(tmp, ARCH)
        _add_metadata(writer, gguf, cfg, gguf_type, vocab)
        for name, array in tensors.items():
            _add_tensor(writer, gguf, name, array, gguf_type, moments)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return out


def _check_out(build_dir: Path, out: Path, overwrite: bool) -> None:
    """Refuse a destination inside the build folder (which holds only what its manifest records), one that is a
    folder, and an existing file unless `overwrite`."""
    if out.resolve().is_relative_to(build_dir.resolve()):
        raise PackageError(f"{out}: inside the build folder {build_dir}, which holds only what its manifest "
                           "records; write the GGUF file elsewhere")
    if out.is_dir():
        raise PackageError(f"{out}: a folder; give the GGUF file's path (e.g. {out / 'model.gguf'})")
    if (out.exists() or out.is_symlink()) and not overwrite:
        raise PackageError(f"{out} exists; give --overwrite (overwrite=True) to replace it")


def _load(graph: Path):
    import onnx

    return onnx.load(str(graph))  # its weights: checked above to be the manifest's, beside it


def gpt2_tensors(model, cfg) -> dict[str, np.ndarray]:
    """The weights of an andrea-export float32 standard graph under llama.cpp's gpt2 tensor names, as numpy
    arrays in ggml's order (a linear layer's weight [out, in], the embeddings [rows, n_embd]). Found by the
    graph's structure: the two embedding Gathers, the LayerNormalizations in order (2 per layer, then the final
    one), the weight MatMuls with the bias Add after each (qkv, attention output, MLP up, MLP down per layer),
    and the tied head (MatMul of the transposed token embedding). Anything else is refused (PackageError)."""
    from onnx import numpy_helper

    g = model.graph
    inits = {t.name: t for t in g.initializer}
    readers: dict[str, list[Any]] = {}
    for n in g.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)

    def value(name: str) -> np.ndarray:
        return numpy_helper.to_array(inits[name]).astype(np.float32)

    E, L = cfg.n_embd, cfg.n_layer
    embeddings = {tuple(inits[n.input[0]].dims): n.input[0] for n in g.node
                  if n.op_type == "Gather" and n.input[0] in inits}
    wte, wpe = embeddings.get((cfg.vocab_size, E)), embeddings.get((cfg.n_positions, E))
    norms = [(n.input[1], n.input[2]) for n in g.node if n.op_type == "LayerNormalization" and len(n.input) == 3]
    linears: list[tuple[str, str | None]] = []
    heads: list[Any] = []
    for n in g.node:
        if n.op_type != "MatMul":
            continue
        if n.input[1] in inits:
            adds = [a for a in readers.get(n.output[0], []) if a.op_type == "Add"]
            bias = [i for a in adds for i in a.input if i in inits]
            linears.append((n.input[1], bias[0] if len(adds) == 1 and len(bias) == 1 else None))
        else:
            heads.extend(p for p in g.node if p.output and p.output[0] == n.input[1] and p.op_type == "Transpose"
                         and p.input[0] in inits)  # not attention's own transposes (of activations)
    shapes = [(E, 3 * E), (E, E), (E, 4 * E), (4 * E, E)]
    found = (f"{len(norms)} LayerNormalizations, {len(linears)} weight MatMuls, embeddings "
             f"{'found' if wte and wpe else 'missing'}, {len(heads)} tied heads")
    if (wte is None or wpe is None or len(norms) != 2 * L + 1 or len(linears) != 4 * L or len(heads) != 1
            or heads[0].input[0] != wte):
        raise PackageError(f"the float32 graph is not an andrea-export {cfg.name} graph ({found}; expected "
                           f"{2 * L + 1} LayerNormalizations, {4 * L} weight MatMuls, both embeddings, the tied head)")
    out = {"token_embd.weight": value(wte), "position_embd.weight": value(wpe)}
    names = ("attn_qkv", "attn_output", "ffn_up", "ffn_down")
    for i in range(L):
        for kind, (w, b), shape in zip(names, linears[4 * i:4 * i + 4], shapes):
            if tuple(inits[w].dims) != shape or b is None or tuple(inits[b].dims) != (shape[1],):
                raise PackageError(f"the float32 graph's layer {i} {kind} weight is {list(inits[w].dims)} with "
                                   f"{'a bias' if b else 'no bias'}; {cfg.name} has {list(shape)} and a bias")
            out[f"blk.{i}.{kind}.weight"] = np.ascontiguousarray(value(w).T)
            out[f"blk.{i}.{kind}.bias"] = value(b)
        for kind, (w, b) in zip(("attn_norm", "ffn_norm"), norms[2 * i:2 * i + 2]):
            out[f"blk.{i}.{kind}.weight"], out[f"blk.{i}.{kind}.bias"] = value(w), value(b)
    out["output_norm.weight"], out["output_norm.bias"] = value(norms[-1][0]), value(norms[-1][1])
    return out


def gpt2_vocab(build_dir: Path, vocab_size: int) -> dict | None:
    """The build's tokenizer as llama.cpp's GPT-2 vocabulary (tokens by id, their types, merges, end of text,
    chat template), or None when the build has none. Refused when it does not split text as GPT-2 does (a
    byte-level BPE with GPT-2's regex, no normalizer), which is what llama.cpp's pre-tokenizer "gpt-2" does:
    another tokenizer would give other ids in llama.cpp than here."""
    from .. import userfiles
    from ..runtime import InputError, eos_id, read_tokenizer_config, tokenizer_path

    try:
        path = tokenizer_path(build_dir)
        if path is None:
            return None
        data = userfiles.read_json(path, userfiles.MAX_TOKENIZER_BYTES, "a tokenizer.json", PackageError)
        eos, template = eos_id(build_dir), read_tokenizer_config(build_dir).get("chat_template")
    except InputError as e:
        raise PackageError(str(e)) from None
    model, pre = data.get("model"), data.get("pre_tokenizer")
    model, pre = (model if isinstance(model, dict) else {}), (pre if isinstance(pre, dict) else {})
    byte_level = (pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"))
    if model.get("type") != "BPE" or model.get("byte_fallback") or data.get("normalizer") or not byte_level:
        raise PackageError(f"{path}: not a GPT-2 byte-level BPE tokenizer (model {model.get('type')!r}, pre-tokenizer "
                           f"{pre.get('type')!r}, normalizer {'set' if data.get('normalizer') else 'none'}); llama.cpp's "
                           "GPT-2 vocabulary would split text otherwise")
    vocab, added_tokens = model.get("vocab"), data.get("added_tokens") or []
    if not isinstance(vocab, dict) or not isinstance(added_tokens, list) or not all(isinstance(a, dict) for a in added_tokens):
        raise PackageError(f"{path}: its vocabulary is not a mapping of tokens to ids with a list of added tokens")
    tokens: dict[int, tuple[str, int]] = {i: (text, 1) for text, i in vocab.items()}  # gguf.TokenType.NORMAL
    for added in added_tokens:
        tokens[added.get("id")] = (added.get("content"), 3 if added.get("special") else 4)  # CONTROL, USER_DEFINED
    if not all(isinstance(i, int) and not isinstance(i, bool) and isinstance(t, str) for i, (t, _) in tokens.items()):
        raise PackageError(f"{path}: a token that is not a string, or an id that is not an integer")
    if not tokens or max(tokens) >= vocab_size or min(tokens) < 0:
        raise PackageError(f"{path}: token ids run to {max(tokens, default=-1)}; the model has {vocab_size}")
    raw = model.get("merges") or []
    merges = [m if isinstance(m, str) else " ".join(m) if isinstance(m, list) and all(isinstance(x, str) for x in m)
              else None for m in (raw if isinstance(raw, list) else [None])]
    if any(not isinstance(m, str) or m.count(" ") != 1 for m in merges):
        raise PackageError(f"{path}: a merge is not a pair of tokens without spaces")
    listed = [tokens.get(i, (f"[PAD{i}]", 5)) for i in range(vocab_size)]  # UNUSED, as llama.cpp's converter pads
    return {"tokens": [t for t, _ in listed], "types": [k for _, k in listed], "merges": merges, "eos": eos,
            "chat_template": template if isinstance(template, str) else None}


def _add_metadata(writer, gguf, cfg, gguf_type: str, vocab: dict | None) -> None:
    writer.add_name(cfg.name)
    writer.add_file_type(int(getattr(gguf.LlamaFileType, GGUF_TYPES[gguf_type][1])))
    if gguf_type.startswith("q"):
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(cfg.n_positions)
    writer.add_embedding_length(cfg.n_embd)
    writer.add_feed_forward_length(4 * cfg.n_embd)
    writer.add_block_count(cfg.n_layer)
    writer.add_head_count(cfg.n_head)
    writer.add_layer_norm_eps(cfg.layer_norm_eps)
    if vocab is None:  # ids in, logits out: llama.cpp's "no vocab" model of this many tokens
        writer.add_tokenizer_model("none")
        writer.add_vocab_size(cfg.vocab_size)
        return
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])
    writer.add_token_merges(vocab["merges"])
    if vocab["eos"] is not None:
        writer.add_bos_token_id(vocab["eos"])  # GPT-2's convention (model/gpt2.hf_config): one id for both
        writer.add_eos_token_id(vocab["eos"])
    writer.add_add_bos_token(False)
    if vocab["chat_template"]:
        writer.add_chat_template(vocab["chat_template"])


def _add_tensor(writer, gguf, name: str, array: np.ndarray, gguf_type: str, moments: dict | None = None) -> None:
    """One tensor in the type `gguf_type` asks for: vectors f32; the token embedding q8_0 at 4 and 5 bits; a
    linear layer's weight whose input moment `moments` holds (weight_moments), in q4_0, solved by GPTQ."""
    kind = "q8_0" if name == "token_embd.weight" and gguf_type in LOW_BITS else gguf_type
    qtype = getattr(gguf.GGMLQuantizationType, GGUF_TYPES[kind][0])
    if kind in GPTQ_TYPES and array.ndim == 2 and array.shape[1] % GGML_BLOCK == 0:
        from ..graphs.quantize import weight_digest

        w = np.ascontiguousarray(array.T, dtype=np.float32)  # ggml's [out, in] as the graph's [K, N]
        if (moment := (moments or {}).get(weight_digest(w))) is not None:
            writer.add_tensor(name, q4_0_blocks(w, moment), raw_dtype=qtype)
            return
    if array.ndim == 1 or kind == "f32":
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    elif kind == "f16":
        writer.add_tensor(name, array.astype(np.float16))
    else:
        if array.shape[-1] % GGML_BLOCK and kind != "bf16":
            raise PackageError(f"{name}: rows of {array.shape[-1]} values do not split into ggml's blocks of "
                               f"{GGML_BLOCK}; write --gguf-type f32, f16 or bf16")
        writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)


def q4_0_blocks(w: np.ndarray, moment: np.ndarray) -> np.ndarray:
    """ggml's Q4_0 bytes [N, K / 32 * 18] of a linear layer's weight w [K, N] (the graph's layout; ggml's rows are
    its N columns), its integers chosen by GPTQ against `moment` (graphs/quantize.quantize_gptq, form "q4_0"):
    each block of 32 along a row is its float16 scale, then 16 bytes holding values j and j + 16 in the low and
    high nibble of byte j, as ggml's block_q4_0 lays them out."""
    from ..graphs.quantize import quantize_gptq

    K, N = w.shape
    q, scales, _ = quantize_gptq(w, moment, 4, GGML_BLOCK, form="q4_0")
    rows = q.T.reshape(N, K // GGML_BLOCK, GGML_BLOCK)
    nibbles = (rows[..., :16] | (rows[..., 16:] << 4)).astype(np.uint8)
    d = np.ascontiguousarray(scales.T.astype("<f2")).view(np.uint8).reshape(N, K // GGML_BLOCK, 2)
    return np.concatenate([d, nibbles], axis=-1).reshape(N, -1)

"""Checkpoints: load weights into the reference model, save them, or make seeded random ones.

Two layouts are read:
  * the project's own: the model's state_dict names (`wte.weight`, `h.0.attn.c_attn.weight`, ...),
    `nn.Linear` weights as [out, in]; written by `save_checkpoint` with the config in the metadata.
  * GPT-2 (Hugging Face): the same names, optionally under `transformer.`, but the four projections are
    `Conv1D` weights stored transposed ([in, out]); `lm_head.weight`, if present, must equal `wte`.
The layout is told by the fused QKV weight: [3C, C] is ours, [C, 3C] is Conv1D (C != 3C, so never ambiguous).

Where the weights are (`resolve_checkpoint`): a file, or a Hugging Face `save_pretrained` folder
(`model.safetensors`, or shards listed in `model.safetensors.index.json`). A `config.json` in the folder,
or beside a bare file, is read by gpt2.read_hf_config (not guessed from shapes). The folder is untrusted
input: every file read from it (`_checkpoint_file`: the index, each shard it names, model.safetensors,
config.json) is a plain name in it that resolves inside it, or inside its hub-cache repo folder.

Files are never unpickled: `.safetensors` is read with safetensors; `.pt/.bin` only with
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from ..config import ModelConfig, safe_name
from ..errors import CheckpointError, ConfigError
from ..folder.atomic import atomic_path, sha256_file
from ..folder.reader import inside
from ..names import CONFIG_KEY
from ..progress import warn
from ..userfiles import MAX_JSON_BYTES, loads_json, read_json
from .andrea import Andrea
from .gpt2 import CONV1D, HF_IGNORED, read_hf_config

WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)  # what is read as float32 weights
GPT2_HEADS = {768: 12, 1024: 16, 1280: 20, 1600: 25}  # every GPT-2 size: head_dim 64


def random_init(cfg: ModelConfig, seed: int = 0, announce: bool = True) -> Andrea:
    """GPT-2-style initialisation (normal std 0.02, residual projections scaled by 1/sqrt(2*n_layer)),
    seeded. Announced on stderr so nobody mistakes the result for trained weights."""
    if announce:
        warn(f"no checkpoint given: using RANDOM weights (seed {seed}) for {cfg.name}; outputs are meaningless text")
    gen = torch.Generator().manual_seed(seed)
    model = Andrea(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name == "ln_f.weight":
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith("c_proj.weight") else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.weights_source = {"kind": "random-init", "seed": seed}
    return model.eval()


def load_checkpoint(path: str | Path, config: ModelConfig | None = None) -> Andrea:
    """Load a checkpoint into a new reference model (float32, eval mode).

    Args:
        path: a `.safetensors` file (project or GPT-2 layout), `.pt/.bin` (read with weights_only=True), or a
            Hugging Face `save_pretrained` folder (config.json + model.safetensors or sharded safetensors).
        config: the expected config. Without it the config is read from the file's metadata, else from a
            GPT-2 `config.json` (in the folder or beside the file), else inferred from the tensor shapes
            (vocab, width, depth, context; heads only for GPT-2's own widths).
    """
    path = Path(path)
    files, hf_json = resolve_checkpoint(path)
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, str] = {}
    for f in files:
        t, meta = _read_tensors(f)
        if twice := sorted(set(t) & set(tensors)):
            raise CheckpointError(f"{path}: tensor '{twice[0]}' is stored in more than one shard")
        tensors.update(t)
    tied = True
    if hf_json is not None:
        hf_cfg, tied = read_hf_config(hf_json, name=path.stem)  # refuses erf-GELU etc. even when config is given
        config = config or hf_cfg
    tensors = _to_project_layout(tensors, path, tied)
    cfg = config or _config_from(tensors, meta, path)
    with torch.device("meta"):  # the shapes the config gives, checked before its weights are allocated
        _check_against(Andrea(cfg), tensors, path)
    model = Andrea(cfg)
    model.load_state_dict(tensors, strict=True)
    # no path: the same bytes give the same ONNX bytes wherever they lie
    model.weights_source = {"kind": "checkpoint", "sha256": checkpoint_sha256(path)}
    return model.eval()


INDEX = "model.safetensors.index.json"


def resolve_checkpoint(path: Path) -> tuple[list[Path], Path | None]:
    """(weight files, GPT-2 config.json or None) for a checkpoint file or a save_pretrained folder."""
    if path.is_dir():
        if (path / INDEX).is_file():
            files = _shards(path, _checkpoint_file(path, INDEX, str(path)))
        elif (path / "model.safetensors").is_file():
            files = [_checkpoint_file(path, "model.safetensors", str(path))]
        else:
            raise CheckpointError(f"{path}: a checkpoint folder needs model.safetensors or {INDEX} "
                                  "(a Hugging Face save_pretrained folder)")
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{path}: no config.json in the checkpoint folder (save_pretrained writes one)")
        return files, _checkpoint_file(path, "config.json", str(path))
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file or folder")
    beside = path.parent / "config.json"
    if path.suffix != ".safetensors" or not beside.is_file() or CONFIG_KEY in _read_metadata(path):
        return [path], None  # a project checkpoint carries its own config; a config.json beside it is not read
    return [path], _checkpoint_file(path.parent, "config.json", str(path.parent))  # read unasked: same rule


def _checkpoint_file(folder: Path, name: str, what: str) -> Path:
    """`folder / name`, a file of a checkpoint folder (untrusted): a plain name (no '..', no sub-folder, not
    absolute) that resolves inside the folder, or, when the folder is a snapshot of the Hugging Face hub
    cache, inside that repo's folder; else CheckpointError. The one rule for every file read from a
    checkpoint folder.

    The hub cache is how most people hold a downloaded checkpoint: models--org--name/ holds blobs/ (the
    files, named by hash), refs/ and snapshots/<revision>/, whose files are symlinks to ../../blobs/<hash>.
    Those links leave the snapshot folder but not the repo folder, which is what the user pointed at (one
    level up from a revision they chose); a link that resolves outside the repo folder is refused like any
    other. A folder passes for a snapshot only by that shape: its parent is `snapshots` and its
    grandparent has `blobs/`."""
    snapshot = folder.resolve()
    repo = snapshot.parent.parent
    hub = snapshot.parent.name == "snapshots" and (repo / "blobs").is_dir()
    return inside(folder, name, what, CheckpointError, flat=True, kind="checkpoint folder",
                  within=repo if hub else None)


def _read_metadata(path: Path) -> dict[str, str]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable .safetensors file (truncated or another format?): {e}") from None


def _shards(folder: Path, index: Path) -> list[Path]:
    """The shard files an index names, each checked to lie inside `folder` (untrusted input)."""
    data = read_json(index, MAX_JSON_BYTES, "a safetensors index", CheckpointError)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: 'weight_map' must be a non-empty object of tensor name -> file name")
    files = []
    for name in dict.fromkeys(weight_map.values()):
        if not isinstance(name, str) or not name.endswith(".safetensors"):
            raise CheckpointError(f"{index}: shard {name!r} is not a .safetensors file name")
        f = _checkpoint_file(folder, name, f"{index}: shard")
        if not f.is_file():
            raise CheckpointError(f"{index}: shard {name!r} is missing from {folder}")
        files.append(f)
    return files


def checkpoint_sha256(path: str | Path) -> str:
    """sha256 of a checkpoint: of the file itself, or, when more files make it (shards, a config.json
    that sets its shape), of their names and sha256s in order."""
    files, hf_json = resolve_checkpoint(Path(path))
    parts = files + ([hf_json] if hf_json is not None else [])
    if len(parts) == 1:
        return sha256_file(parts[0])
    import hashlib

    return hashlib.sha256("".join(f"{p.name}:{sha256_file(p)}\n" for p in parts).encode()).hexdigest()


def save_checkpoint(model: Andrea, path: str | Path) -> Path:
    """Write the project layout (safetensors, config in the metadata), atomically."""
    from safetensors.torch import save_file

    path = Path(path)
    state = {k: v.detach().float().contiguous().cpu() for k, v in model.state_dict().items()}
    with atomic_path(path) as tmp:
        save_file(state, str(tmp), metadata={CONFIG_KEY: json.dumps(model.cfg.to_dict(), sort_keys=True)})
    return path


def _read_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    if path.stat().st_size == 0:
        raise CheckpointError(f"{path}: the file is empty (0 bytes): not a checkpoint (an interrupted download or copy?)")
    if path.suffix in (".pt", ".pth", ".bin"):
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # UnpicklingError for pickled code, RuntimeError for corrupt zips
            raise CheckpointError(
                f"{path}: cannot be read as a plain tensor state dict with torch.load(weights_only=True) "
                f"({type(e).__name__}: {str(e).splitlines()[0]}); convert it to .safetensors"
            ) from None
        for key in ("state_dict", "model"):  # common training-script wrappers
            if isinstance(obj, dict) and isinstance(obj.get(key), dict):
                obj = obj[key]
        if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
            raise CheckpointError(f"{path}: expected a dict of tensors (a state dict), got {type(obj).__name__}")
        return dict(obj), {}
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            return {k: f.get_tensor(k) for k in f.keys()}, meta
    except (SafetensorError, OSError) as e:
        raise CheckpointError(
            f"{path}: not a readable .safetensors file (truncated or another format?): {e}"
        ) from None


def _to_project_layout(tensors: dict[str, torch.Tensor], path: Path, tied: bool = True) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, v in tensors.items():
        k = k.removeprefix("transformer.")
        if HF_IGNORED.match(k):
            continue
        out[k] = v
    head = out.pop("lm_head.weight", None)
    qkv = out.get("h.0.attn.c_attn.weight")
    if qkv is not None and qkv.ndim == 2 and qkv.shape[1] == 3 * qkv.shape[0]:  # GPT-2 Conv1D: [in, out]
        for k in list(out):
            if k.endswith(CONV1D):
                out[k] = out[k].t().contiguous()
    if head is not None and "wte.weight" in out and not torch.equal(head, out["wte.weight"]):
        raise CheckpointError(
            f"{path}: tensor 'lm_head.weight' differs from 'wte.weight'; ANDREA ties the output projection "
            "to the token embedding, so an untied head cannot be represented"
        )
    if not tied and head is None:  # transformers would give the untied head fresh random weights
        raise CheckpointError(f"{path}: config.json says tie_word_embeddings false, but there is no 'lm_head.weight'; "
                              "ANDREA's output projection is the token embedding, so an untied head is refused")
    for k, v in out.items():
        if v.dtype not in WEIGHT_DTYPES:  # float8 and the like too: no isfinite, no float32 conversion to trust
            raise CheckpointError(f"{path}: tensor '{k}' has dtype {v.dtype}; weights must be floating point: "
                                  f"{', '.join(str(d).removeprefix('torch.') for d in WEIGHT_DTYPES)}")
        if not torch.isfinite(v).all():
            bad = (~torch.isfinite(v)).sum().item()
            raise CheckpointError(f"{path}: tensor '{k}' contains {bad} NaN/Inf value(s)")
        out[k] = v.float()
    return out


def _config_from(tensors: dict[str, torch.Tensor], meta: dict[str, str], path: Path) -> ModelConfig:
    if CONFIG_KEY in meta:
        try:
            data = loads_json(meta[CONFIG_KEY], f"{path} metadata", f"'{CONFIG_KEY}'", CheckpointError)
            return ModelConfig.from_dict(data, source=f"{path} metadata")
        except ConfigError as e:
            raise CheckpointError(f"{path}: bad '{CONFIG_KEY}' metadata: {e}") from None
    for k in ("wte.weight", "wpe.weight", "h.0.attn.c_attn.weight"):
        if k not in tensors:
            raise CheckpointError(f"{path}: missing tensor '{k}', so the model shape cannot be inferred")
    for k, dims in (("wte.weight", 2), ("wpe.weight", 2)):
        if tensors[k].dim() != dims:
            raise CheckpointError(f"{path}: tensor '{k}' has shape {list(tensors[k].shape)}; a {dims}-D tensor "
                                  "was expected, so the model shape cannot be inferred")
    vocab, n_embd = tensors["wte.weight"].shape
    n_layer = 1 + max(int(m.group(1)) for k in tensors if (m := re.match(r"h\.(\d+)\.", k)))
    if n_embd not in GPT2_HEADS:
        raise CheckpointError(
            f"{path}: the number of attention heads cannot be inferred from tensor shapes (width {n_embd} is not "
            "a GPT-2 size); put the model's config.json beside it, or pass a config file with 'n_head' (--config)"
        )
    return ModelConfig(
        name=safe_name(path.stem), vocab_size=vocab, n_embd=n_embd, n_layer=n_layer, n_head=GPT2_HEADS[n_embd],
        n_positions=tensors["wpe.weight"].shape[0],
    )


def _check_against(model: Andrea, tensors: dict[str, torch.Tensor], path: Path) -> None:
    expected = model.state_dict()
    missing = [k for k in expected if k not in tensors]
    unexpected = [k for k in tensors if k not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensor(s): {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))
        if unexpected:
            parts.append(f"unexpected tensor(s): {', '.join(unexpected[:5])}" + (" ..." if len(unexpected) > 5 else ""))
        raise CheckpointError(f"{path}: does not fit {model.cfg.name}: " + "; ".join(parts))
    for k, v in expected.items():
        if tuple(tensors[k].shape) != tuple(v.shape):
            raise CheckpointError(
                f"{path}: tensor '{k}' has shape {list(tensors[k].shape)}, expected {list(v.shape)} for {model.cfg.name}"
            )


def model_for(source: dict, cfg: ModelConfig | None, checkpoint: str | Path | None = None, what: str = "it",
              command: str | None = None) -> Andrea:
    """The model whose weights an artifact records as `source` (its `weights_source`): the given
    checkpoint, checked against the recorded sha256, or the recorded seeded random init. Refuses to
    guess when the artifact came from a checkpoint that is not given. `what` names the artifact; `command`
    is the command line that would pass the checkpoint, for that message."""
    from ..folder.reader import check_weights_source

    if source != {}:  # recorded by whoever wrote the file: checked before it is used ({} means not recorded)
        check_weights_source(source, f"{what}: its weight source")
    if checkpoint is not None:
        if source.get("kind") == "random-init":
            raise CheckpointError(f"{what} was made from random weights (seed {source['seed']}), not from a "
                                  f"checkpoint; leave out --checkpoint {checkpoint}")
        model = load_checkpoint(checkpoint, cfg)
        if source.get("sha256") not in (None, model.weights_source["sha256"]):
            raise CheckpointError(f"{what} was made from a checkpoint with sha256 {source['sha256'][:12]}..., "
                                  f"not from {checkpoint} ({model.weights_source['sha256'][:12]}...)")
        return model
    if source.get("kind") == "random-init" and cfg is not None:
        return random_init(cfg, seed=source["seed"])
    if source.get("kind") == "checkpoint":
        raise CheckpointError(f"{what}: its weights came from a checkpoint; pass that checkpoint: "
                              f"{command or '--checkpoint CHECKPOINT'} (sha256 {str(source.get('sha256'))[:12]}...; "
                              "a path recorded beside the weights is never opened: it may come from anyone)")
    raise CheckpointError(f"{what}: records no weight source (not made by andrea-export); pass --checkpoint and --config")


def load_model(checkpoint: str | Path | None = None, config: ModelConfig | None = None, seed: int = 0) -> Andrea:
    """The model a pipeline starts from: a checkpoint, or (announced) seeded random weights."""
    from ..config import ANDREA_120M

    if checkpoint is None:
        return random_init(config or ANDREA_120M, seed=seed)
    return load_checkpoint(checkpoint, config)

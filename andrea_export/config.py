"""Model configurations: a frozen dataclass, the named presets, and JSON files a user can copy and edit.

The presets live here (so an installed wheel has them) and in `models/*.json` (so a user can read and
copy them); a test keeps the two identical.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from .errors import ConfigError
from .userfiles import MAX_CONFIG_BYTES, read_json

# What the toolkit supports, field by field and in total (a config is read from files anyone can write: a
# bound keeps a claimed model from allocating until memory runs out). Far above ANDREA-120M's and GPT-2 XL's
# shapes; the total is about 8 GB of float32 weights, already more than a build fits in on a 24 GB machine.
LIMITS = {"vocab_size": 1 << 18, "n_embd": 16384, "n_layer": 256, "n_head": 256, "n_positions": 1 << 17}
MAX_PARAMS = 2_000_000_000


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The shape of an ANDREA/GPT-2-family decoder. See ../shared/spec/ANDREA-120M.md."""

    name: str = "andrea-120m"
    vocab_size: int = 8449
    n_embd: int = 768  # d_model
    n_layer: int = 12
    n_head: int = 12
    n_positions: int = 1024  # maximum context
    layer_norm_eps: float = 1e-5

    def __post_init__(self):
        check_name(self.name)
        for f in ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"model config '{self.name}': field '{f}' must be a positive integer, got {v!r:.40}")
            if v > LIMITS[f]:
                raise ConfigError(f"model config '{self.name}': field '{f}' is {v:,}; andrea-export supports at most "
                                  f"{LIMITS[f]:,}")
        if not isinstance(self.layer_norm_eps, (int, float)) or not 0 < self.layer_norm_eps < 1:
            raise ConfigError(
                f"model config '{self.name}': field 'layer_norm_eps' must be a number in (0, 1), got {self.layer_norm_eps!r}"
            )
        if self.n_embd % self.n_head:
            raise ConfigError(
                f"model config '{self.name}': field 'n_head' ({self.n_head}) must divide 'n_embd' ({self.n_embd})"
            )
        if self.n_params > MAX_PARAMS:
            raise ConfigError(f"model config '{self.name}': {self.n_params:,} parameters; andrea-export supports at "
                              f"most {MAX_PARAMS:,} (about 8 GB of float32 weights)")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_params(self) -> int:
        """Parameter count with the tied embedding counted once."""
        d, v, L = self.n_embd, self.vocab_size, self.n_layer
        block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
        return v * d + self.n_positions * d + L * block + 2 * d

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict, source: str = "config") -> "ModelConfig":
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown field(s) {', '.join(unknown)}; known fields: {', '.join(sorted(known))}")
        try:
            return cls(**data)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None


# A model name becomes a folder name (out/<name>-<precision>) and part of a Triton model name, itself a
# folder name; both are read from files anyone can write (config JSON, checkpoint and ONNX metadata, a
# manifest): one path component, no more, not hidden, not an option. One rule for both, so a name that
# builds also packages. 128 characters leave room in a 255-byte folder name for a precision, a suffix
# and a staging folder's prefix and suffix.
MAX_NAME = 128
NAME_RE = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.-]{{0,{MAX_NAME - 1}}}")


def check_name(name, what: str = "model config: field 'name'", error: type[Exception] = ConfigError) -> str:
    """`name` when it is a safe name (letters, digits, '_', '-', '.'; starts with a letter or digit; at most
    MAX_NAME characters), else `error` saying what `what` must be."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        got = f"{len(name)} characters" if isinstance(name, str) and len(name) > MAX_NAME else repr(name)[:80]
        raise error(f"{what} must be 1-{MAX_NAME} letters, digits, '_', '-' or '.', starting with a letter or digit "
                    f"(it names a folder), got {got}")
    return name


def safe_name(text: str) -> str:
    """A model name made from free text (a checkpoint's file name): unsafe characters become '-'."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-._")[:64]  # short: a folder name, with room to spare
    return name if NAME_RE.fullmatch(name) else "model"


ANDREA_120M = ModelConfig()
ANDREA_TINY = ModelConfig(name="andrea-tiny", vocab_size=8449, n_embd=64, n_layer=2, n_head=4, n_positions=128)
PRESETS = {c.name: c for c in (ANDREA_120M, ANDREA_TINY)}


def load_config(name_or_path: str | Path | ModelConfig) -> ModelConfig:
    """A preset by name (`andrea-120m`, `andrea-tiny`) or a JSON file with ModelConfig's fields (a ModelConfig
    is taken as it is)."""
    if isinstance(name_or_path, ModelConfig):
        return name_or_path
    key = str(name_or_path)
    if key in PRESETS:
        return PRESETS[key]
    path = Path(key)
    if not (path.exists() or path.is_symlink()):
        raise ConfigError(f"no model config '{key}': not a preset ({', '.join(PRESETS)}) and not a file")
    data = read_json(path, MAX_CONFIG_BYTES, "a model config", ConfigError)
    return ModelConfig.from_dict(data, source=str(path))

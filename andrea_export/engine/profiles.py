"""Optimization profiles of `input_ids` (min/opt/max of batch and sequence), parsed from the command line's
"batch=1:4:16,seq=1:128:1024" and checked against the model and TensorRT's tensor-volume limit.

The words are Polygraphy's: a `Profile` is one optimization profile (the shapes an engine accepts), a
`Bounds` is the min/opt/max of one of its dimensions."""

from __future__ import annotations

import dataclasses
import re

from ..config import ModelConfig
from ..errors import ConfigError
from ..names import INPUT_IDS

TENSOR_VOLUME_LIMIT = 2**31  # TensorRT: "the volume of the tensor must be less than 2^31 elements"


@dataclasses.dataclass(frozen=True)
class Bounds:
    """min/opt/max of one dimension of input_ids."""

    min: int
    opt: int
    max: int

    def check(self, field: str) -> "Bounds":
        vals = (self.min, self.opt, self.max)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in vals) or not 1 <= self.min <= self.opt <= self.max:
            raise ConfigError(
                f"profile '{field}': expected min:opt:max with 1 <= min <= opt <= max, got {self.min}:{self.opt}:{self.max}"
            )
        return self

    def __str__(self) -> str:
        return f"{self.min}:{self.opt}:{self.max}"


@dataclasses.dataclass(frozen=True)
class Profile:
    """One TensorRT optimization profile for input_ids [batch, seq]."""

    batch: Bounds = Bounds(1, 1, 8)
    seq: Bounds = Bounds(1, 128, 1024)

    def check(self, context: int | None = None) -> "Profile":
        """Validate; `context` is the model's maximum sequence length (n_positions)."""
        self.batch.check("batch")
        self.seq.check("seq")
        if context is not None and self.seq.max > context:
            raise ConfigError(f"profile 'seq': max {self.seq.max} exceeds the model's context of {context} tokens")
        return self

    def check_tensor_sizes(self, cfg: ModelConfig) -> "Profile":
        """Refuse maxima whose largest tensor TensorRT cannot hold: "the volume of the tensor must be less
        than 2^31 elements" (ITensor). The largest are the logits [batch, seq, vocab] and the attention
        scores [batch, heads, seq, seq]."""
        b, t = self.batch.max, self.seq.max
        per_sequence = max(t * cfg.vocab_size, cfg.n_head * t * t)
        if b * per_sequence >= TENSOR_VOLUME_LIMIT:
            limit = (TENSOR_VOLUME_LIMIT - 1) // per_sequence
            raise ConfigError(
                f"profile 'batch': max {b} with seq max {t} makes a tensor of {b * per_sequence:,} elements "
                f"({'logits' if t * cfg.vocab_size >= cfg.n_head * t * t else 'attention scores'}), and TensorRT "
                f"allows fewer than 2^31 per tensor: use a batch max of at most {limit} for {cfg.name} at {t} tokens"
            )
        return self

    @classmethod
    def for_model(cls, cfg: ModelConfig, max_batch: int = 8) -> "Profile":
        """Defaults for a model: batch 1:1:max_batch, seq 1:min(128, context):context."""
        return cls(Bounds(1, 1, max_batch), Bounds(1, min(128, cfg.n_positions), cfg.n_positions))

    @classmethod
    def parse(cls, text: str, base: "Profile | None" = None) -> "Profile":
        """"batch=1:4:16,seq=1:128:1024"; a dimension left out keeps `base`'s; "batch=4" means 4:4:4."""
        fields = dataclasses.asdict(base or cls())
        fields = {k: Bounds(**v) for k, v in fields.items()}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep:
                raise ConfigError(f"profile '{text}': expected entries like batch=1:4:16,seq=1:128:1024")
            if key not in fields:
                raise ConfigError(f"profile: unknown dimension '{key}'; known: batch, seq")
            nums = value.strip().split(":")
            if len(nums) not in (1, 3) or not all(re.fullmatch(r"\d+", n) for n in nums):
                raise ConfigError(f"profile '{key}': '{value.strip()}' is not min:opt:max (or one size) of integers")
            ints = [int(n) for n in nums] * (3 if len(nums) == 1 else 1)
            fields[key] = Bounds(*ints)
        return cls(**fields).check()

    def shapes(self) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        return (self.batch.min, self.seq.min), (self.batch.opt, self.seq.opt), (self.batch.max, self.seq.max)

    def input_shapes(self) -> dict[str, dict[str, list[int]]]:
        """The shapes of every input, as `kvcache.optimization_profiles` gives a decoder's: the one form the
        builder sets on TensorRT."""
        return {INPUT_IDS: {k: list(s) for k, s in zip(("min", "opt", "max"), self.shapes())}}

    def to_dict(self) -> dict:
        return {"batch": str(self.batch), "seq": str(self.seq)}


Profiles = Profile  # the name of one optimization profile before it took Polygraphy's word


def parse_profiles(text: str, base: Profile | None = None) -> list[Profile]:
    """Several optimization profiles, separated by ';': "batch=1,seq=1:1:1;batch=1:4:16,seq=1:128:1024"."""
    parts = [p for p in text.split(";") if p.strip()]
    if not parts:
        raise ConfigError("profile: empty; expected entries like batch=1:4:16,seq=1:128:1024")
    return [Profile.parse(p, base) for p in parts]

"""What verification feeds the models: the (batch, seq) shapes, the greedy prompt's length, and the check that
they fit the model, made before any work."""

from __future__ import annotations


def default_shapes(n_positions: int) -> list[tuple[int, int]]:
    """Batch x sequence shapes verified by default: one token, a short prompt, batch > 1, the full context."""
    shapes = [(1, 1), (1, min(17, n_positions)), (4, min(64, n_positions)), (2, n_positions)]
    return list(dict.fromkeys(shapes))


GREEDY_PROMPT = 8  # tokens of the prompt greedy decoding starts from (the KV-cache check uses 8 too)


def check_inputs(cfg, shapes=None, greedy_steps: int = 0) -> None:
    """Raise ConfigError when verification shapes or greedy steps do not fit the model (before any work)."""
    from ..errors import ConfigError

    for s in shapes or []:
        b, t = s
        if b < 1 or not 1 <= t <= cfg.n_positions:
            raise ConfigError(f"verify shape {b}x{t} does not fit {cfg.name}: batch >= 1 and 1 <= seq <= "
                              f"{cfg.n_positions} (the model's context of {cfg.n_positions} tokens)")
    room = cfg.n_positions - GREEDY_PROMPT
    if greedy_steps and greedy_steps > room:
        raise ConfigError(f"--greedy-steps {greedy_steps}: with a prompt of {GREEDY_PROMPT} tokens at most {room} "
                          f"tokens fit the model's context of {cfg.n_positions} tokens")

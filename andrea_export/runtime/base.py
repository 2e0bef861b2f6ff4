"""The Session contract every backend implements, and everything that is the same for all of them: input
checks (before anything runs), the generation loop over a batch of requests, sampling.

A backend provides `_steps()`: a context manager that gives one call its own `Steps`, the KV cache of
that call's batch, kept where the backend computes (host memory for ONNX Runtime's CPU provider, device
memory for CUDA / TensorRT):

    steps.prefill(ids [B, T], mask [B, T])      -> logits [B, T, vocab]   starts the cache from the prompts
    steps.decode(tokens [B], mask [B, P + 1])   -> logits [B, vocab]      appends one token to every row

Batches: prompts of different lengths are padded on the left (id 0, mask 0). The graph masks padded keys
and derives each token's position from the mask, so a row computes what its prompt alone would. Every
request draws from its own generator, seeded with its own `seed`, and stops on its own (its stop ids, its
`max_new_tokens`, and the model's end-of-text token unless it sets `ignore_eos`, as every peer stops by default):
a batched call gives each prompt the tokens it gets alone. (A padded row's fp32 logits
can differ from its unpadded ones in the last bits, as sums run over a longer, masked key axis: at most
4e-7 on the tiny test model. Tokens could differ only at a tie to that precision.)

Threads: one Session may serve many threads at once. A call keeps everything it changes (cache, mask,
generators) in itself, never in the session. A backend whose state cannot be per call (TensorRT: one
execution context, one set of device buffers and one captured CUDA graph per session) derives from
`SerialSession`, which runs one call at a time under a lock, one sequence at a time.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import threading
from collections.abc import Iterator, Sequence
from typing import ContextManager, Protocol, TypeGuard, cast

import numpy as np

from ..config import ModelConfig
from ..errors import InputError
from ..graphs.layout import KVLayout
from ..names import MAX_SEED
from .sampling import Sampling, next_token

PAD_ID = 0  # what padded positions hold; masked out, so any valid id would do


class SlotCache(Protocol):
    """What runtime/batcher.py steps: a fixed set of cache slots, one sequence each (ort.py's OrtSlotCache on the
    CPU, trt_slots.py's TrtSlotCache on a GPU). `run(group, [chunk])` runs a group of slots (first, ids, held),
    and with it a joining prompt's chunk, and returns their logits."""

    layout: KVLayout
    slots: int
    max_chunk: int  # the most tokens one row of a run may hold (the engine's prefill chunk; n_positions on ORT)

    def run(self, group: tuple, chunk: tuple | None = None) -> tuple[np.ndarray, np.ndarray | None]: ...

    def close(self) -> None: ...


def check_apart(a: tuple, b: tuple) -> None:
    """Two groups of one run may share a slot only where one of them writes a pad past all the other holds:
    else one would overwrite the other's keys and values."""
    (fa, ida, ha), (fb, idb, hb) = a, b
    for slot in set(range(fa, fa + len(ida))) & set(range(fb, fb + len(idb))):
        held_a, held_b = int(ha[slot - fa]), int(hb[slot - fb])
        if not (held_a - ida.shape[1] >= held_b or held_b - idb.shape[1] >= held_a):
            raise ValueError(f"run: slot {slot} is written by both groups (held {held_a} and {held_b})")


def check_ids(ids, vocab_size: int, what: str = "prompt") -> list[int]:
    """`ids` as a list of ints; InputError if empty, not integers, or outside [0, vocab_size)."""
    try:
        arr = np.asarray(ids)
    except ValueError:  # ragged nesting
        raise InputError(f"{what} must be a flat sequence of token ids") from None
    if arr.ndim != 1:
        raise InputError(f"{what} must be a flat sequence of token ids, got an array of shape {list(arr.shape)}")
    if arr.size == 0:
        raise InputError(f"{what} is empty: give at least one token id")
    if arr.dtype == object and all(isinstance(x, int) and not isinstance(x, bool) for x in arr):
        i = next(i for i, x in enumerate(arr) if not 0 <= x < vocab_size)  # ints past int64: numpy keeps objects
        raise InputError(f"{what} token id {arr[i]} at position {i} is outside the vocabulary [0, {vocab_size})")
    if not np.issubdtype(arr.dtype, np.integer):
        raise InputError(f"{what} must hold integer token ids, got {arr.dtype}")
    bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
    if bad.size:
        i = int(bad[0])
        raise InputError(
            f"{what} token id {int(arr[i])} at position {i} is outside the vocabulary [0, {vocab_size})"
            + (f" ({bad.size} such ids)" if bad.size > 1 else "")
        )
    return [int(x) for x in arr]


@dataclasses.dataclass(frozen=True)
class Request:
    """One prompt to continue, with its own settings: the arguments `generate` takes for one prompt."""

    prompt_ids: Sequence[int]
    max_new_tokens: int
    strategy: str = "greedy"
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 0.9
    seed: int | None = None
    stop_ids: Sequence[int] = ()
    ignore_eos: bool = False  # run on past the end-of-text token (Session.eos_id) to max_new_tokens


@dataclasses.dataclass
class CheckedRequest:
    """A checked request, as the loop runs it."""

    prompt: list[int]
    max_new_tokens: int
    sampling: Sampling
    rng: np.random.Generator
    stops: frozenset[int]


class Steps(abc.ABC):
    """The KV cache of one call's batch (see the module docstring). Used by that call only."""

    @abc.abstractmethod
    def prefill(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """ids, mask int64 [B, T] -> logits float32 [B, T, vocab] on the host; the cache now holds the rows."""

    @abc.abstractmethod
    def decode(self, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """tokens int64 [B], mask int64 [B, P + 1] -> logits float32 [B, vocab]; appends the tokens."""


class Session(abc.ABC):
    """A loaded decoder. `forward(ids)` -> logits; `generate(prompt or prompts, ...)` -> new token ids.

    Thread safety: every public method may be called from several threads at once on one session (see the
    backend's docstring for whether such calls run in parallel or one after another)."""

    backend: str = "?"
    max_batch: int | None = None  # rows one step may hold; None: as many as a call brings
    weights_source: dict | None = None  # what the graph's metadata records (runtime.load sets it)
    eos_id: int | None = None  # the end-of-text token, where the build's tokenizer names one (runtime.load sets it)

    def __init__(self, cfg: ModelConfig, layout: KVLayout, source: str):
        self.cfg = cfg
        self.layout = layout
        self.source = source

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.cfg.name} backend={self.backend} from {self.source}>"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        """Release device memory and handles (ONNX Runtime frees on garbage collection; TensorRT frees here)."""

    def slot_cache(self, slots: int) -> SlotCache:
        """`slots` sequences' cache for in-flight batching (runtime/batcher.py), which only ONNX Runtime's sessions
        of the in-place decoder have (ort.py); any other session refuses here, by name."""
        raise InputError(f"{self.source}: in-flight batching needs an ONNX Runtime session of the in-place decoder "
                         f"(this is a {self.backend} session)")

    @abc.abstractmethod
    def _steps(self, capacity: int | None = None) -> ContextManager[Steps]:
        """A fresh cache for one call (held for the whole call), for at most `capacity` tokens per row
        (None: the model's context); a backend that preallocates its cache sizes it by this."""

    # -- public API --------------------------------------------------------------------------------------
    def forward(self, ids: Sequence[int]) -> np.ndarray:
        """Logits [len(ids), vocab] (float32) for a sequence: one prefill."""
        ids = check_ids(ids, self.cfg.vocab_size, "input")
        if len(ids) > self.cfg.n_positions:
            raise InputError(f"input ({len(ids)} tokens) exceeds the model's context of {self.cfg.n_positions} tokens")
        row = np.asarray([ids], dtype=np.int64)
        with self._steps(len(ids)) as steps:
            return steps.prefill(row, np.ones_like(row))[0]

    def forward_stepwise(self, ids: Sequence[int], prompt_len: int) -> np.ndarray:
        """Logits [len(ids), vocab] as generation computes them: one prefill of the first `prompt_len` ids,
        then one decode step per remaining id through the KV cache. Equal to forward(ids) up to rounding;
        with len(ids) = n_positions its last steps decode at past n - 2 and n - 1, which generate never
        reaches (its last new token is not fed back), so verification checks that boundary this way."""
        ids = check_ids(ids, self.cfg.vocab_size, "input")
        if len(ids) > self.cfg.n_positions:
            raise InputError(f"input ({len(ids)} tokens) exceeds the model's context of {self.cfg.n_positions} tokens")
        if not 1 <= prompt_len <= len(ids):
            raise InputError(f"prompt_len must be 1..{len(ids)}, got {prompt_len}")
        row = np.asarray([ids[:prompt_len]], dtype=np.int64)
        with self._steps(len(ids)) as steps:
            out = [steps.prefill(row, np.ones_like(row))[0]]
            for p in range(prompt_len, len(ids)):
                out.append(steps.decode(np.asarray([ids[p]], dtype=np.int64), np.ones((1, p + 1), dtype=np.int64)))
        return np.concatenate(out, axis=0)

    def generate(
        self,
        prompt_ids: Sequence[int] | Sequence[Sequence[int]],
        max_new_tokens: int | Sequence[int],
        strategy: str = "greedy",
        temperature: float = 1.0,
        top_k: int = 50,
        top_p: float = 0.9,
        seed: int | None | Sequence[int | None] = None,
        stop_ids: Sequence[int] = (),
        ignore_eos: bool = False,
    ) -> list[int] | list[list[int]]:
        """The new token ids (the prompt not repeated). Stops after `max_new_tokens` or at the first id in
        `stop_ids` or the end-of-text token (`eos_id`, unless `ignore_eos`), which is included as the last
        element. `seed` makes top-k / top-p sampling repeatable.

        `prompt_ids` may also be a list of prompts (of any lengths): they run as one batch and the result
        is a list, one list of new ids per prompt. Then `max_new_tokens` and `seed` may be lists too (one per
        prompt); one `seed` seeds every prompt's own generator, so each prompt gets the tokens it gets alone.
        For settings that differ in other ways, see `generate_batch`."""
        if _is_batch(prompt_ids):
            n = len(prompt_ids)
            lengths, seeds = _per_prompt(max_new_tokens, n, "max_new_tokens"), _per_prompt(seed, n, "seed")
            return self.generate_batch([Request(p, m, strategy, temperature, top_k, top_p, s, stop_ids, ignore_eos)
                                        for p, m, s in zip(prompt_ids, lengths, seeds)])
        one = Request(cast(Sequence[int], prompt_ids), cast(int, max_new_tokens), strategy, temperature, top_k, top_p,
                      cast("int | None", seed), stop_ids, ignore_eos)  # one prompt: _check checks each value
        return self._generate([self._check(one)])[0]

    def generate_batch(self, requests: Sequence[Request]) -> list[list[int]]:
        """The new ids of every request, in order. Consecutive requests run together in batches (as many as
        the backend steps at once and the context allows: longest prompt + most new tokens <= n_positions);
        each keeps its own sampling, seed, stop ids and length (a row that has stopped rides along, unread,
        until its batch ends). Every request is checked before anything runs."""
        if not len(requests):
            raise InputError("no requests: give at least one prompt")
        rows = [self._check(r, f"request {i}" if len(requests) > 1 else None) for i, r in enumerate(requests)]
        return [tokens for chunk in self._chunks(rows) for tokens in self._generate(chunk)]

    def stream(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        strategy: str = "greedy",
        temperature: float = 1.0,
        top_k: int = 50,
        top_p: float = 0.9,
        seed: int | None = None,
        stop_ids: Sequence[int] = (),
        ignore_eos: bool = False,
    ) -> Iterator[tuple[int, np.ndarray]]:
        """Like `generate` for one prompt, one (token, logits it was chosen from) at a time. All input is
        checked before the first step runs. The call holds its cache (on a SerialSession: the session)
        until the iterator is exhausted or closed."""
        row = self._check(Request(prompt_ids, max_new_tokens, strategy, temperature, top_k, top_p, seed, stop_ids,
                                  ignore_eos))
        return (event for events in self._loop([row]) if (event := events[0]) is not None)

    def check(self, request: Request) -> CheckedRequest:
        """`request` checked against this model (InputError naming the bad field), with its own generator:
        what the batcher (runtime/batcher.py) admits."""
        return self._check(request)

    # -- the loop ----------------------------------------------------------------------------------------
    def _check(self, r: Request, where: str | None = None) -> CheckedRequest:
        """The request checked (InputError naming `where`, if given), with its generator."""
        try:
            cfg = self.cfg
            prompt = check_ids(r.prompt_ids, cfg.vocab_size, "prompt")
            n = r.max_new_tokens
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
                raise InputError(f"max_new_tokens must be a positive integer, got {n!r}")
            if len(prompt) + n > cfg.n_positions:
                raise InputError(
                    f"prompt ({len(prompt)} tokens) + max_new_tokens ({n}) = {len(prompt) + n} "
                    f"exceeds the model's context of {cfg.n_positions} tokens"
                )
            sampling = Sampling(r.strategy, r.temperature, r.top_k, r.top_p).check(cfg.vocab_size)
            stops = check_ids(list(r.stop_ids), cfg.vocab_size, "stop_ids") if len(r.stop_ids) else []
            s = r.seed
            if s is not None and (isinstance(s, bool) or not isinstance(s, (int, np.integer)) or not 0 <= s <= MAX_SEED):
                raise InputError(f"seed must be an integer in 0..2**63-1 (or none), got {s!r}")
            if not isinstance(r.ignore_eos, (bool, np.bool_)):
                raise InputError(f"ignore_eos must be true or false, got {r.ignore_eos!r}")
            if self.eos_id is not None and not r.ignore_eos:
                stops.append(self.eos_id)
        except InputError as e:
            if where is None:
                raise
            raise InputError(f"{where}: {e}") from None
        return CheckedRequest(prompt, int(n), sampling, np.random.default_rng(r.seed), frozenset(stops))

    def _chunks(self, rows: list[CheckedRequest]) -> Iterator[list[CheckedRequest]]:
        """Consecutive rows, grouped as one step can hold them: at most max_batch rows, and the longest
        prompt plus the most new tokens within the context (a padded row's cache is as long as the longest)."""
        limit, context = self.max_batch or len(rows), self.cfg.n_positions
        chunk: list[CheckedRequest] = []
        for row in rows:
            width = max([len(r.prompt) for r in chunk] + [len(row.prompt)])
            steps = max([r.max_new_tokens for r in chunk] + [row.max_new_tokens])
            if chunk and (len(chunk) == limit or width + steps > context):
                yield chunk
                chunk = []
            chunk.append(row)
        if chunk:
            yield chunk

    def _generate(self, rows: list[CheckedRequest]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in rows]
        for events in self._loop(rows):
            for tokens, event in zip(out, events):
                if event is not None:
                    tokens.append(event[0])
        return out

    def _loop(self, rows: list[CheckedRequest]) -> Iterator[list[tuple[int, np.ndarray] | None]]:
        """Per step, for every row: (token, the logits it was chosen from), or None once the row has stopped."""
        width = max(len(r.prompt) for r in rows)
        ids = np.full((len(rows), width), PAD_ID, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        for i, r in enumerate(rows):  # left padding: every row's last token is in the last column
            ids[i, width - len(r.prompt):] = r.prompt
            mask[i, width - len(r.prompt):] = 1
        done = [False] * len(rows)
        with self._steps(width + max(r.max_new_tokens for r in rows) - 1) as steps:  # the last token is not fed back
            logits = steps.prefill(ids, mask)[:, -1]
            for step in range(max(r.max_new_tokens for r in rows)):
                tokens = np.full(len(rows), PAD_ID, dtype=np.int64)  # a stopped row's input, never read back
                events: list[tuple[int, np.ndarray] | None] = [None] * len(rows)
                for i, r in enumerate(rows):
                    if done[i]:
                        continue
                    tok = next_token(logits[i], r.sampling, r.rng)
                    events[i], tokens[i] = (tok, logits[i]), tok
                    done[i] = tok in r.stops or step == r.max_new_tokens - 1
                yield events
                if all(done):
                    return
                mask = np.concatenate([mask, np.ones((len(rows), 1), dtype=np.int64)], axis=1)
                logits = steps.decode(tokens, mask)


class SerialSession(Session):
    """A backend whose cache lives in the session itself (one set of device buffers, one execution context,
    a captured CUDA graph): calls run one at a time under a lock, and a batch runs one sequence after
    another (batch 1: no padding). Threads may share it; they take turns, one request at a time.

    Subclasses implement two steps over that one cache, and what close() frees:
        _prefill(ids) -> logits [len(ids), vocab]   starts the cache from `ids` (a list of ints)
        _decode(token) -> logits [vocab]            appends `token` (an int)
        _release()                                  frees the cache (device memory, handles)

    close() takes the same lock as a call: it waits for a running call to end instead of freeing the buffers
    under it, and a call after close() is refused (InputError) instead of touching freed memory.
    """

    max_batch = 1

    def __init__(self, cfg: ModelConfig, layout: KVLayout, source: str):
        super().__init__(cfg, layout, source)
        self._lock = threading.Lock()
        self._holder: int | None = None  # the thread inside a call
        self._closed = False

    def _release(self) -> None:
        """Free what the session holds; called once, by close(), under the lock."""

    def close(self) -> None:
        self._refuse_own_call("close it")
        with self._lock:
            if not self._closed:
                self._closed = True
                self._release()

    def _refuse_own_call(self, doing: str) -> None:
        if self._holder == threading.get_ident():  # taking the lock would wait for itself
            raise InputError(f"{self.source}: this thread is already in a call of this session (an unfinished "
                             f"stream?); finish or close that call before you {doing}")

    @abc.abstractmethod
    def _prefill(self, ids: list[int]) -> np.ndarray:
        """Start the cache with `ids`; logits [len(ids), vocab] float32 on the host."""

    @abc.abstractmethod
    def _decode(self, token: int) -> np.ndarray:
        """Append `token` to the cache; logits [vocab] float32 on the host."""

    @contextlib.contextmanager
    def _steps(self, capacity: int | None = None) -> Iterator[Steps]:
        self._refuse_own_call(f"start another (a {self.backend} session runs one call at a time)")
        with self._lock:
            if self._closed:
                raise InputError(f"{self.source}: this session is closed; load a new one")
            self._holder = threading.get_ident()
            try:
                yield _SessionSteps(self)
            finally:
                self._holder = None


class _SessionSteps(Steps):
    def __init__(self, session: SerialSession):
        self.session = session

    def prefill(self, ids, mask):
        assert ids.shape[0] == 1 and mask.all(), "a SerialSession steps one unpadded sequence"
        return self.session._prefill(ids[0].tolist())[None]

    def decode(self, tokens, mask):
        return self.session._decode(int(tokens[0]))[None]


def _is_batch(prompt_ids) -> TypeGuard[Sequence[Sequence[int]]]:
    """A list of prompts (rather than one prompt): its first element is itself a sequence."""
    return isinstance(prompt_ids, (list, tuple, np.ndarray)) and len(prompt_ids) > 0 and isinstance(
        prompt_ids[0], (list, tuple, np.ndarray))


def _per_prompt(value, n: int, name: str) -> list:
    """`value` for each of n prompts: a list of n values as it is, anything else repeated."""
    if isinstance(value, (list, tuple, np.ndarray)):
        if len(value) != n:
            raise InputError(f"{name}: {len(value)} values for {n} prompts (give one, or one per prompt)")
        return list(value)
    return [value] * n

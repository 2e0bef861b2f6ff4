"""In-flight batching: requests join and leave one running batch at step boundaries, each streaming its tokens.

    from andrea_export import runtime
    from andrea_export.runtime.batcher import Batcher

    with Batcher(runtime.load("out/build", "onnxruntime"), slots=8) as batcher:
        ticket = batcher.submit(runtime.Request([1, 2, 3], 32, seed=0), print)   # print gets each Event
        ...
        ticket.cancel()                                                        # frees its slot at the next step

One engine thread owns a SlotCache (ort.py's OrtSlotCache on the CPU, trt_slots.py's TrtSlotCache on a GPU: one
slot per sequence). Each step:
  1. admit waiting requests into free slots (lowest first, so the running slots stay packed at the front);
  2. cancelled requests leave, each with a final event;
  3. one run (the slot cache's two groups, graphs/two_groups.py: every weight read once for both):
     - the chunk: the next `prefill_chunk` tokens (at most) of the oldest admission's prompt (a long prompt
       joins over several steps instead of stalling every stream for a whole prefill); with a budget of
       `step_tokens` and rows decoding, the rows first and the chunk the rest (at least MIN_CHUNK); a slot
       whose prompt is complete samples its first token from the chunk's last logits;
     - the decoding rows, slots 0 .. the highest decoding one: decoding slots feed their last token; the
       others (free, or part-way through their prompt) feed a pad token that writes the position after what
       they hold, which their next real write overwrites and nothing reads (the slot whose chunk is in this
       run writes its pad at the context's last position instead, clear of its chunk);
     a step with a chunk used to cost two runs: 16 rows decoding and a chunk of 8 tokens take 66-68 ms in
     one against 86-92 in two (ANDREA-120M fp32, 2 cores, Intel Xeon; decode alone 51-58 ms);
  4. each decoding slot samples its token with its own settings and generator, and leaves when it stops.

A request's tokens are exactly those of `Session.generate` run alone with the same settings and seed: the
slot cache's runs give a sequence the same logits, bit for bit, whatever shares the step (tests hold it),
and sampling draws from each request's own generator in the same order. A request that fails its check
raises InputError from `submit` (naming the field) and never reaches the batch; a step that raises ends
every running request with an error event and the batcher goes on with the next ones. Nothing here knows
Triton: deploy/triton/generate.py wraps it in a Python-backend model.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from ..names import PREFILL_CHUNK
from .base import PAD_ID, CheckedRequest, Request, Session
from .sampling import next_token


@dataclasses.dataclass(frozen=True)
class Event:
    """What a request's callback gets: each new token, then (with the last one, or alone) `final`. reason:
    "length" (max_new_tokens reached), "stop" (a stop id, included as the token), "cancelled", "error"."""

    token: int | None
    final: bool = False
    reason: str | None = None
    error: str | None = None


class Ticket:
    """A submitted request: `cancel()` makes it leave at the next step (its callback gets a final event)."""

    def __init__(self, number: int):
        self.number = number
        self.cancelled = threading.Event()
        self.finished = threading.Event()  # set after the final event was handed to the callback
        self.submitted = time.perf_counter()

    def cancel(self) -> None:
        self.cancelled.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self.finished.wait(timeout)


@dataclasses.dataclass
class _Slot:
    ticket: Ticket
    row: CheckedRequest
    emit: Callable[[Event], None]
    fed: int = 0  # prompt tokens in the cache
    held: int = 0  # tokens in the cache (the prompt's, then one per decode step)
    last: int | None = None  # the token to feed next (None: still prefilling)
    produced: int = 0
    submitted: float = dataclasses.field(default_factory=time.monotonic)


ADMIT = ("in-flight", "whole")
MIN_CHUNK = 8  # the fewest prompt tokens a step with a joining prompt feeds, whatever decodes beside it


class Batcher:
    """In-flight batching over `session`'s in-place cache (see the module docstring). `slots`: the most
    requests that share a step; `prefill_chunk`: the most prompt tokens prefilled per step (one run): the trade between
    a joining request's first token and the running streams' worst gap (ANDREA-120M fp32, 16 clients, 2
    cores, in process, steady state: 64 gave a first token at 101 / 348 ms p50 / p99 and an inter-token p99
    of 2.9x its median, 32 gave 152 / 520 ms and 1.9x, and 5 % fewer tokens/s). `step_tokens`: a budget of
    tokens per step while rows decode (vLLM's max_num_batched_tokens): even gaps for later first tokens (16
    clients, in process, chunk 64: no budget 270 / 673 ms and 4.0x; 32: 544 / 1308 ms and 1.8x). `admit`:
    "in-flight" (a request joins at the next step) or "whole" (requests join only an idle batch, which then
    runs until its last request ends: batching of whole requests, as a dynamic batcher does, for comparison)."""

    def __init__(self, session: Session, slots: int = 8, prefill_chunk: int = PREFILL_CHUNK, admit: str = "in-flight",
                 step_tokens: int | None = None, on_admit: Callable[[float], None] | None = None):
        for name, value in (("prefill_chunk", prefill_chunk), ("step_tokens", 1 if step_tokens is None else step_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.step_tokens = step_tokens
        self.on_admit = on_admit  # gets each request's seconds in the queue, on the engine thread, as it takes a slot
        if admit not in ADMIT:
            raise ValueError(f"admit must be one of {', '.join(ADMIT)}, got {admit!r}")
        self.admit = admit
        self.session = session
        self.cache = session.slot_cache(slots)  # raises for a session without the in-place cache
        self.slots: list[_Slot | None] = [None] * slots
        self.prefill_chunk = min(prefill_chunk, self.cache.max_chunk)  # an engine's profile bounds its chunk
        self._waiting: deque[_Slot] = deque()
        self._wake = threading.Condition()
        self._accepting = True
        self._stop = False
        self._numbers = itertools.count()
        self.steps = 0  # decode runs so far
        self.step_rows: list[int] = []  # requests decoding in each run (the benchmark reads it)
        self._thread = threading.Thread(target=self._engine, name="andrea-batcher", daemon=True)
        self._thread.start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop(drain=exc[0] is None)

    # -- from any thread ---------------------------------------------------------------------------------
    def submit(self, request: Request, emit: Callable[[Event], None]) -> Ticket:
        """Queue `request`; `emit` gets its Events on the engine thread (keep it short: hand them on). Raises
        InputError for a bad request and RuntimeError once the batcher stopped accepting."""
        row = self.session.check(request)
        ticket = Ticket(next(self._numbers))
        with self._wake:
            if not self._accepting:
                raise RuntimeError("the batcher is stopping: no new requests")
            self._waiting.append(_Slot(ticket, row, emit))
            self._wake.notify()
        return ticket

    def submit_all(self, requests: Sequence[tuple[Request, Callable[[Event], None]]]) -> list[Ticket]:
        """submit() each (request, emit) as one: the engine thread admits none of them before the last is queued,
        so a schedule (which slot each takes, who joins whom) does not hang on how this thread is scheduled."""
        with self._wake:  # re-entrant: submit() takes it again
            return [self.submit(request, emit) for request, emit in requests]

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting; with `drain`, finish every request in flight and waiting, else cancel them; then end
        the engine thread and close the slot cache (a session outlives its batchers: a TensorRT cache's device
        memory and CUDA graphs would otherwise stay until the session closes). A thread still running after
        `timeout` keeps its cache."""
        with self._wake:
            self._accepting = False
            if not drain:
                for s in [*self._waiting, *filter(None, self.slots)]:
                    s.ticket.cancel()
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.cache.close()  # once: every slot cache's close is

    @property
    def active(self) -> int:
        return self.running + self.waiting

    @property
    def running(self) -> int:
        """Requests in a slot (prefilling or decoding)."""
        return sum(s is not None for s in self.slots)

    @property
    def waiting(self) -> int:
        """Requests queued for a slot."""
        return len(self._waiting)

    # -- the engine thread -------------------------------------------------------------------------------
    def _engine(self) -> None:
        while True:
            with self._wake:
                while not self._stop and not self._waiting and not any(self.slots):
                    self._wake.wait()
                if self._stop and not self._waiting and not any(self.slots):
                    return
                if self.admit == "in-flight" or not any(self.slots):
                    for i in range(len(self.slots)):  # admit, lowest free slot first
                        if self.slots[i] is None and self._waiting:
                            slot = self.slots[i] = self._waiting.popleft()
                            if self.on_admit is not None:
                                self.on_admit(time.monotonic() - slot.submitted)
            try:
                self._step()
            except Exception as e:  # the step's state is unknown: end every running request, go on
                message = f"{type(e).__name__}: {e}"
                for i, s in enumerate(self.slots):
                    if s is not None:
                        self._finish(i, Event(None, True, "error", message))

    def _step(self) -> None:
        for i, s in enumerate(self.slots):
            if s is not None and s.ticket.cancelled.is_set():
                self._finish(i, Event(None, True, "cancelled"))
        chunk, joining = None, None
        prefilling = [(s.ticket.number, i) for i, s in enumerate(self.slots) if s is not None and s.last is None]
        decoding = [i for i, s in enumerate(self.slots) if s is not None and s.last is not None]
        if prefilling:
            joining = min(prefilling)[1]
            s = self._held(joining)
            n = self.prefill_chunk
            if decoding and self.step_tokens is not None:  # a budget for the step: the decoding rows first
                n = min(n, max(self.step_tokens - len(decoding), MIN_CHUNK))
            n = min(n, len(s.row.prompt) - s.fed)
            chunk = (joining, np.asarray([s.row.prompt[s.fed:s.fed + n]]), np.asarray([s.fed + n]))
        group = None
        if decoding:
            rows = max(decoding) + 1
            ids = np.full((rows, 1), PAD_ID, dtype=np.int64)
            held = np.ones(rows, dtype=np.int64)
            for i in range(rows):
                slot = self.slots[i]
                held[i] = (slot.held if slot is not None else 0) + 1
                if slot is not None and slot.last is not None:  # decoding (as `decoding` reads it)
                    ids[i, 0] = slot.last
            if joining is not None and joining < rows:  # its pad goes where its chunk neither writes nor reads
                held[joining] = self.cache.layout.n_positions
            group = (0, ids, held)
        logits: np.ndarray | None
        chunk_logits: np.ndarray | None
        if group is None:
            if chunk is None:
                return
            logits, chunk_logits = None, self.cache.run(chunk)[0]
        else:
            logits, chunk_logits = self.cache.run(group, chunk)
        if chunk is not None:
            assert joining is not None and chunk_logits is not None  # a chunk is the joining slot's, and has logits
            s = self._held(joining)
            s.fed = s.held = int(chunk[2][0])
            if s.fed == len(s.row.prompt):
                self._sample(joining, s, chunk_logits[0, -1])
        if group is None or logits is None:
            return
        self.steps += 1
        self.step_rows.append(len(decoding))
        for i in decoding:
            s = self._held(i)
            s.held += 1
            self._sample(i, s, logits[i, -1])

    def _sample(self, i: int, s: _Slot, logits: np.ndarray) -> None:
        tok = next_token(logits, s.row.sampling, s.row.rng)
        s.produced += 1
        s.last = tok
        reason = "stop" if tok in s.row.stops else "length" if s.produced == s.row.max_new_tokens else None
        if reason:
            self._finish(i, Event(tok, True, reason))
        elif not self._emit(s, Event(tok)):
            self._finish(i, Event(None, True, "cancelled"))

    def _held(self, i: int) -> _Slot:
        """Slot `i`, which holds a request (the step's bookkeeping says so: a None here is a bug)."""
        s = self.slots[i]
        assert s is not None, f"slot {i} is free"
        return s

    def _finish(self, i: int, event: Event) -> None:
        s = self._held(i)
        self.slots[i] = None
        self._emit(s, event)
        s.ticket.finished.set()

    @staticmethod
    def _emit(s: _Slot, event: Event) -> bool:
        """Hand `event` to the request's callback; False when the callback raised (its client is gone)."""
        try:
            s.emit(event)
            return True
        except Exception:
            s.ticket.cancel()
            return False

"""In-flight batching (runtime/batcher.py) on the lively model's in-place decoders (GroupQueryAttention, and the
slot decoder TensorRT takes, on ONNX Runtime and as a TensorRT slot engine on the strict stand-ins of
fake_cuda.py, padded to buckets and replayed from captured graphs): requests of different prompt and output lengths joining and
leaving one running batch each get exactly the tokens `generate` gives them alone; cancellation, bad requests,
a failing step and stopping behave as a service needs."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from andrea_export import runtime
from andrea_export.errors import InputError
from andrea_export.runtime import Request
from andrea_export.runtime.batcher import Batcher, Event


@pytest.fixture(scope="module", params=["inplace", "slots", "tensorrt"])
def session(request, lively_model, tmp_path_factory):
    from andrea_export.graphs.inplace_decoder import export_inplace_decoder
    from andrea_export.graphs.slot_decoder import export_slot_decoder

    if request.param == "tensorrt":  # the slot engine on the strict TensorRT and CUDA stand-ins (fake_cuda.py)
        return request.getfixturevalue("trt_slot_session")
    export = export_inplace_decoder if request.param == "inplace" else export_slot_decoder
    path = export(lively_model, tmp_path_factory.mktemp(request.param) / f"decoder.{request.param}.onnx", quiet=True)
    return runtime.load(path, backend="onnxruntime")


class Collector:
    """A request's callback: its tokens and its final event, with a flag set when it ends (and one, `reached`,
    when it has `signal_at` tokens; with `hold`, the batcher's thread, which runs the callback, waits there until
    `release` is set, so that a test acts at that step however late its own thread is scheduled)."""

    def __init__(self, signal_at: int | None = None, hold: bool = False):
        self.tokens, self.final, self.done = [], None, threading.Event()
        self.signal_at, self.reached = signal_at, threading.Event()
        self.hold, self.release = hold, threading.Event()

    def __call__(self, e: Event):
        if e.token is not None:
            self.tokens.append(e.token)
            if len(self.tokens) == self.signal_at:
                self.reached.set()
                if self.hold:
                    self.release.wait(30)
        if e.final:
            self.final = e
            self.done.set()


def _requests(n: int, vocab: int) -> list[Request]:
    rng = np.random.default_rng(7)
    out = []
    for i in range(n):
        prompt = rng.integers(0, vocab, int(rng.integers(1, 60))).tolist()
        strategy = ("greedy", "top-k", "top-p")[i % 3]
        out.append(Request(prompt, int(rng.integers(1, 40)), strategy, temperature=0.8, top_k=20, top_p=0.9, seed=i))
    return out


def test_requests_joining_a_running_batch_get_exactly_their_tokens_alone(session):
    """16 requests, mixed lengths and settings, submitted from threads at staggered times into 4 slots with a
    small prefill chunk (so prompts join over several steps while others decode): each one's tokens are those
    of generate alone, and steps really were shared."""
    requests = _requests(16, session.cfg.vocab_size)
    alone = [session.generate_batch([r])[0] for r in requests]
    got = [Collector() for _ in requests]
    with Batcher(session, slots=4, prefill_chunk=8) as b:
        def client(i):
            time.sleep(0.002 * (i % 5))
            b.submit(requests[i], got[i])

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(requests))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(c.done.wait(60) for c in got)
    assert [c.tokens for c in got] == alone
    assert {c.final.reason for c in got} <= {"length", "stop"}
    assert max(b.step_rows) > 1  # rows shared steps


def test_a_stop_id_ends_the_request_with_it(session):
    prompt = [5, 6, 7]
    free = session.generate(prompt, 20)
    stop = free[6]
    c = Collector()
    with Batcher(session, slots=2) as b:
        b.submit(Request(prompt, 20, stop_ids=[stop]), c)
        assert c.done.wait(30)
    assert c.tokens == free[:free.index(stop) + 1] and c.final.reason == "stop"


def test_cancel_frees_the_slot_at_once(session):
    """One slot: a long request is cancelled after a few tokens; the next request, queued behind it, runs."""
    first, second = Collector(signal_at=3), Collector()
    with Batcher(session, slots=1) as b:
        t1 = b.submit(Request([1, 2, 3], 100), first)
        t2 = b.submit(Request([4, 5], 5), second)
        assert first.reached.wait(30)
        t1.cancel()
        assert first.done.wait(30) and second.done.wait(30)
    assert first.final.reason == "cancelled" and 3 <= len(first.tokens) < 100
    assert second.tokens == session.generate([4, 5], 5) and t1.finished.is_set() and t2.finished.is_set()


def test_a_callback_that_raises_is_a_client_gone(session):
    """A callback that raises (its client disconnected) cancels its own request only."""
    ok = Collector()

    def gone(e):
        raise ConnectionResetError("client went away")

    with Batcher(session, slots=2) as b:
        t = b.submit(Request([1, 2, 3], 50), gone)
        b.submit(Request([9, 8], 6), ok)
        assert t.wait(30) and ok.done.wait(30)
    assert ok.tokens == session.generate([9, 8], 6)


def test_bad_requests_are_refused_at_submit_naming_the_field(session):
    n, vocab = session.cfg.n_positions, session.cfg.vocab_size
    ok = Collector()
    with Batcher(session, slots=2) as b:
        b.submit(Request([1, 2], 8), ok)
        for bad, field in ((Request([vocab], 4), "prompt"), (Request([1] * (n - 2), 5), "exceeds the model's context"),
                           (Request([1], 0), "max_new_tokens"), (Request([1], 4, "top-k", top_k=0), "top_k"),
                           (Request([1], 4, stop_ids=[-1]), "stop_ids"), (Request([], 4), "prompt")):
            with pytest.raises(InputError, match=field):
                b.submit(bad, Collector())
        assert ok.done.wait(30)
    assert ok.tokens == session.generate([1, 2], 8)


def test_a_failing_step_ends_the_running_requests_with_an_error_and_the_next_ones_run(session, monkeypatch):
    b = Batcher(session, slots=2)
    real, calls = b.cache.run, {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device lost")
        return real(*a, **k)

    monkeypatch.setattr(b.cache, "run", flaky)
    first, after = Collector(), Collector()
    b.submit(Request([1, 2, 3], 20), first)
    assert first.done.wait(30)
    assert first.final.reason == "error" and "device lost" in first.final.error
    b.submit(Request([3, 2], 6), after)
    assert after.done.wait(30)
    b.stop()
    assert after.tokens == session.generate([3, 2], 6)


def test_stop_drains_or_cancels(session):
    running, queued = Collector(), Collector()
    b = Batcher(session, slots=1)
    b.submit(Request([1, 2], 30), running)
    b.submit(Request([2, 3], 30), queued)
    b.stop(drain=True)
    assert running.tokens == session.generate([1, 2], 30) and queued.tokens == session.generate([2, 3], 30)
    with pytest.raises(RuntimeError, match="stopping"):
        b.submit(Request([1], 2), Collector())
    a, c = Collector(), Collector()
    b = Batcher(session, slots=1)
    b.submit(Request([1, 2], 100), a)
    b.submit(Request([2, 3], 100), c)
    b.stop(drain=False)
    assert a.final.reason == "cancelled" and c.final.reason == "cancelled" and len(c.tokens) < 100


def test_the_standard_decoder_is_refused(build_dir):
    with runtime.load(build_dir, backend="onnxruntime") as standard:
        if standard.layout.shared:
            pytest.skip("the folder's ONNX Runtime graph is the in-place one")
        with pytest.raises(InputError, match="in-flight batching needs the in-place decoder"):
            Batcher(standard)


def test_whole_request_batching_admits_only_into_an_idle_batch(session):
    """admit="whole": a request waits until every running one ended (batching of whole requests), and still
    gets its tokens alone."""
    long, short = Collector(), Collector()
    seen_with_long = []
    with Batcher(session, slots=4, admit="whole") as b:
        b.submit(Request([1, 2, 3], 100), lambda e: (long(e), seen_with_long.append(short.done.is_set() or bool(short.tokens))))
        time.sleep(0.01)
        b.submit(Request([4, 5], 3), short)
        assert long.done.wait(30) and short.done.wait(30)
    assert not any(seen_with_long)  # no token of the short one while the long one ran
    assert long.tokens == session.generate([1, 2, 3], 100) and short.tokens == session.generate([4, 5], 3)


def test_a_joining_prompt_shares_the_decoding_rows_run(session):
    """Four short prompts arrive together: each step is one run, which carries the decoding rows and at
    most one prompt's chunk (each run pays for reading every weight, so a chunk rides along with the
    decode instead of a run of its own), and the tokens are still those of generate alone."""
    requests = [Request([1 + i, 2, 3], 6) for i in range(4)]
    got = [Collector() for _ in requests]
    with Batcher(session, slots=4, prefill_chunk=64) as b:
        real, runs = b.cache.run, []

        def counted(group, chunk=None):
            runs.append((group[1].shape[1] == 1, chunk is not None))  # (decoding rows, a chunk)
            return real(group, chunk)

        b.cache.run = counted
        with b._wake:  # hold the engine until all four wait, so that they arrive in one step
            for r, c in zip(requests, got):
                b.submit(r, c)
        assert all(c.done.wait(30) for c in got)
    assert [c.tokens for c in got] == [session.generate(list(r.prompt_ids), 6) for r in requests]
    assert runs[0] == (False, False)  # the first prompt alone: its chunk is the run's only group
    assert runs.count((True, True)) == 3, runs  # the other three joined a decoding run each
    assert b.steps == len(runs) - 1


def test_a_step_budget_shrinks_the_chunk_beside_decoding_rows_only(session):
    """step_tokens: the decoding rows first, the joining prompt's chunk gets the rest of the budget (at least
    MIN_CHUNK), so a long prompt stalls the running streams less; a prompt with no stream decoding beside it
    still takes whole prefill chunks. Tokens stay those of generate alone."""
    from andrea_export.runtime.batcher import MIN_CHUNK

    first, second = Request([3] * 50, 30), Request(list(range(1, 41)), 4)
    got = [Collector(), Collector()]
    with Batcher(session, slots=4, prefill_chunk=32, step_tokens=14) as b:
        real, runs = b.cache.run, []

        def counted(group, chunk=None):
            rows = group[1].shape[0] if group[1].shape[1] == 1 else 0
            runs.append((rows, (chunk or group)[1].shape[1] if chunk or not rows else 0))  # (decoding rows, chunk)
            return real(group, chunk)

        b.cache.run = counted

        def first_then_second(e):  # the second arrives with the first's first token: it joins a decoding step
            if not got[0].tokens:
                b.submit(second, got[1])
            got[0](e)

        b.submit(first, first_then_second)
        assert all(c.done.wait(30) for c in got)
    assert [c.tokens for c in got] == [session.generate(list(r.prompt_ids), r.max_new_tokens) for r in (first, second)]
    assert runs[:2] == [(0, 32), (0, 18)]  # alone: whole chunks
    joined = [n for rows, n in runs[2:] if n]
    assert sum(joined) == 40 and max(joined) <= 14 - 1 and min(joined) >= min(MIN_CHUNK, 40 % 13), runs
    with pytest.raises(ValueError, match="step_tokens"):
        Batcher(session, slots=2, step_tokens=0)


def test_the_slot_cache_commits_its_memory_when_made(session):
    """The slot cache's pages are written when it is made, so the server's memory is known at start and no
    request pays for first touches later (unwritten, the first runs into fresh slots took 160-330 ms against
    20-60 on ANDREA-120M fp32): every page of every buffer is resident at creation (mincore(2))."""
    import ctypes
    import mmap

    if session.backend == "tensorrt":
        pytest.skip("host pages: the TensorRT slot cache lies in device memory, zeroed when made (test_trt_slots.py)")
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    cache = session.slot_cache(256)
    assert sum(b.nbytes for b in cache.buffers) > 16 * 2**20
    for b in cache.buffers:
        start = b.ctypes.data // page * page
        length = b.ctypes.data + b.nbytes - start
        vec = (ctypes.c_ubyte * ((length + page - 1) // page))()
        assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0, ctypes.get_errno()
        resident = sum(v & 1 for v in vec)
        assert resident == len(vec), f"{resident} of {len(vec)} pages resident"


def test_requests_submitted_together_are_admitted_together_however_slow_the_submitter(session, monkeypatch):
    """submit_all: each request is checked (slowly here, as on a busy machine) before any is admitted, so all three
    take their slots at the first step; a schedule built on them (gpu_checks' slot mixed steps) does not hang on
    how the submitting thread is scheduled."""
    import time

    check = session.check
    monkeypatch.setattr(session, "check", lambda r: time.sleep(0.05) or check(r))
    admitted_at: list[int] = []
    with Batcher(session, slots=3, on_admit=lambda _: admitted_at.append(b.steps)) as b:
        collectors = [Collector() for _ in range(3)]
        b.submit_all([(Request([1 + i, 2], 8), c) for i, c in enumerate(collectors)])
        assert all(c.done.wait(30) for c in collectors)
    assert admitted_at == [0, 0, 0]


def test_a_cancelled_request_leaves_its_slot_at_the_next_step(session):
    """Cancelled mid-decode, a request's slot is free when its final event comes (the batcher's own state says
    so), and every step after it decodes the other request alone: it does not ride along, silently, to its
    max_new_tokens."""
    a, other = Collector(signal_at=3, hold=True), Collector()
    with Batcher(session, slots=2) as b:
        ta = b.submit(Request([1, 2, 3], 100), a)
        b.submit(Request([4, 5], 60), other)
        assert a.reached.wait(30)
        ta.cancel()  # while the batcher waits in a's callback: `other` cannot have ended, however busy the machine
        a.release.set()
        assert a.done.wait(30) and a.final.reason == "cancelled"
        assert b.slots[0] is None  # the first request took the lowest slot
        since = len(b.step_rows)
        assert other.done.wait(30)
    after = b.step_rows[since:]
    assert after and set(after) == {1}, after
    assert other.tokens == session.generate([4, 5], 60)


@pytest.mark.parametrize("prompt_len", [127, 126, 100])
def test_a_prompt_filling_the_context_joins_below_a_decoding_row(session, prompt_len):
    """A prompt that fills the context to its last position joins, in chunks, a slot below a request that is
    decoding (so its row in the decoding run is a pad, which must land where neither its chunk nor anyone
    reads); the decoding request itself runs to the context's end. Both get their tokens alone."""
    n = session.cfg.n_positions
    rng = np.random.default_rng(prompt_len)
    first, joining = rng.integers(0, 8449, 5).tolist(), rng.integers(0, 8449, prompt_len).tolist()
    runner = Request(rng.integers(0, 8449, 10).tolist(), n - 10)  # to the context's last position
    short, long_, late = Collector(), Collector(), Collector()
    with Batcher(session, slots=2, prefill_chunk=16) as b:
        b.submit(Request(first, 2), short)  # slot 0, soon free again
        b.submit(runner, long_)  # slot 1: decodes while the long prompt joins in slot 0
        assert short.done.wait(30)
        b.submit(Request(joining, n - prompt_len), late)
        assert long_.done.wait(60) and late.done.wait(60)
    assert long_.tokens == session.generate_batch([runner])[0]
    assert late.tokens == session.generate(joining, n - prompt_len)


def test_the_batcher_says_how_long_each_request_waited_and_how_many_wait(session):
    """on_admit gets each request's seconds in the queue as it takes a slot (one slot: each waits for the one
    before it); `waiting` and `running` count the queue and the slots."""
    waited, got = [], [Collector() for _ in range(3)]
    with Batcher(session, slots=1, on_admit=waited.append) as b:
        with b._wake:  # all three queued before the engine admits the first
            for i, c in enumerate(got):
                b.submit(Request([1 + i, 2], 12), c)
            assert (b.waiting, b.running) == (3, 0)
        assert all(c.done.wait(30) for c in got)
        assert (b.waiting, b.running) == (0, 0)
    assert len(waited) == 3 and 0 <= waited[0] < waited[1] < waited[2]

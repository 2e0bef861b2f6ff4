"""In-flight batching on TensorRT (GPU hosts only): the slot engine's cache on the device, stepped by the same
Batcher (runtime/batcher.py) that steps ONNX Runtime's slot cache (ort.py's OrtSlotCache).

    session = TrtSlotSession("out/build/decoder.slots.plan", cfg, layout)
    with Batcher(session, slots=64) as batcher:
        ...

The engine is built from the slot decoder made two-group (graphs/slot_decoder.py, graphs/two_groups.py) with
`slot_profiles`: DECODE (rows 1..max_slots of one token each, beside a chunk of one token) and MIXED (the same
rows beside a chunk of 1..prefill_chunk tokens), by TensorRT 10.15 or later, whose KV-cache-update layers write
each `present.*` into its `past_key_values.*` where it lies: the two are bound to one address
(`get_aliased_input_tensor` names the pairs; TensorRT reports an API error when they are bound apart).

Memory, all allocated when the cache is made; a step allocates nothing:
- per cache tensor, one device buffer [slots + 1, n_head, n_positions, head_dim], zeroed (unwritten positions
  are masked, but a masked NaN still poisons a softmax): slot i is row i, and the last is a scratch slot for
  the group a step does not need. Every run has both groups: a decode step carries a chunk of one pad token,
  a lone prompt chunk one pad decoding row, each written into the scratch slot;
- each group's ids, mask and logits: device buffers, fed from and read into page-locked host buffers (a copy
  inside a captured graph must not touch pageable memory).

Steps:
- a decode step (the decoding rows, slots 0 .. rows-1, no chunk) is padded up to the next bucket (BUCKETS,
  capped at `slots`: vLLM's and TensorRT-LLM's padding) and replayed as that bucket's CUDA graph (ids and mask
  in, the enqueue, logits out). Every bucket is captured when the cache is made, on the decode profile's one
  execution context; before each replay that context is given the bucket's shapes again, as NVIDIA's
  TensorRT-Edge-LLM executor replays a graph only on the bindings it was captured with (its
  cpp/runtime/exec/engineExecutor.cpp). The pad rows (slots rows .. bucket-1: free, or part-way through a
  prompt) hold n_positions, so each writes the context's last position: no sequence reads that position
  before the step that writes its own token there (a prompt holds at most n_positions - 1 tokens);
- a step with a prompt's chunk runs uncaptured on the mixed profile's context (the chunk's work dwarfs the
  launches a graph would save), the decoding rows and the chunk each bound where their slots lie.
The mask is always n_positions wide: the slot graph reads from it only how many tokens each row holds.

A sequence's logits are those the graph gives it alone, whatever shares its step; the stand-in tests
(tests/runtime/fake_cuda.py) hold the batcher's tokens through this cache to `generate`'s. What a GPU must still
show (benchmarks/gpu_checks.py): when the chunk's slot lies below the decoding rows, the two groups' cache
inputs overlap (the slot's pad row and its chunk). TensorRT says nothing of two inputs aliasing each other; the
pad writes where the chunk neither writes nor reads, and its logits are dropped.

Threads: a cache is stepped by one thread (the batcher's engine thread); the session's own `generate` runs on a
one-slot cache of its own under the session's lock (SerialSession).
"""

from __future__ import annotations

import ctypes
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from ..config import ModelConfig
from ..errors import CudaError, InputError
from ..graphs.layout import KVLayout
from ..graphs.two_groups import PREFIX
from ..names import ATTENTION_MASK, DECODE, INPUT_IDS, LOGITS
from .base import PAD_ID, SerialSession, check_apart
from . import trt as _trt  # its _cudart and _tensorrt looked up at each load (the stand-in tests replace them)
from .trt import TrtSession, _ok, bind, capture, engine_dtypes, enqueue, load_engine

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)  # decode rows a graph is captured for
MIXED = "mixed"  # graphs/slot_decoder.py's profile names
ALIGN = 256  # TensorRT: every tensor address 256-byte aligned


def buckets(slots: int) -> list[int]:
    """The row counts a cache of `slots` captures decode steps for: BUCKETS below `slots`, then `slots`."""
    return [b for b in BUCKETS if b < slots] + [slots]


class TrtSlotSession(SerialSession):
    """A slot engine (see the module docstring): `slot_cache(slots)` for the batcher; `generate` and friends run
    one sequence at a time on a one-slot cache of its own. `capture=False` runs decode steps uncaptured."""

    backend = "tensorrt"

    def __init__(self, engine_path: str | Path, cfg: ModelConfig, layout: KVLayout, *, capture: bool = True):
        super().__init__(cfg, layout, str(engine_path))
        self.cudart = _trt._cudart()  # first: on a machine without a GPU, that is what to say
        self.trt = _trt._tensorrt()
        self.capture = capture
        self.engine: Any = None
        self._runtime: Any = None
        self._caches: list[TrtSlotCache] = []
        self._own: TrtSlotCache | None = None
        self._held = 0
        try:
            self._load(Path(engine_path))
        except BaseException:
            self._closed = True
            self._release()
            raise

    def _load(self, engine_path: Path) -> None:
        trt, L = self.trt, self.layout
        if not L.static:
            raise InputError(f"{self.source}: the slot engine's layout is the slot decoder's static cache; this "
                             f"layout's cache is '{L.cache}' (build the engine from decoder.slots.onnx)")
        self._runtime, self.engine = load_engine(trt, self.cudart, engine_path)
        engine = self.engine
        names = {engine.get_tensor_name(i) for i in range(engine.num_io_tensors)}
        want = {p + t.name for p in ("", PREFIX) for t in L.inputs + L.outputs}
        if names != want:
            raise InputError(f"{self.source}: engine I/O {sorted(names)} is not the two-group slot decoder's "
                             f"{sorted(want)} (graphs/two_groups.py over decoder.slots.onnx)")
        if not hasattr(engine, "get_aliased_input_tensor"):
            raise InputError(f"{self.source}: this TensorRT ({getattr(trt, '__version__', '?')}) cannot say which "
                             "cache input each present output updates (get_aliased_input_tensor); the slot engine "
                             "needs TensorRT 10.15 or later")
        for p in ("", PREFIX):
            for past, present in zip(L.past_names, L.present_names):
                if engine.get_aliased_input_tensor(p + present) != p + past:
                    raise InputError(f"{self.source}: engine output '{p + present}' is not the in-place update of "
                                     f"'{p + past}' (TensorRT reports {engine.get_aliased_input_tensor(p + present)!r}): "
                                     "the slot cache would be copied, not updated where it lies")
        self.dtypes = engine_dtypes(trt, engine, L, self.source, ("", PREFIX))
        for name in L.past_names:
            if tuple(engine.get_tensor_shape(name))[2] != L.n_positions:
                raise InputError(f"{self.source}: engine cache '{name}' is not n_positions ({L.n_positions}) long")
        self.layout = dataclasses.replace(L, cache_dtype=self.dtypes[L.past_names[0]].name)
        self.profiles = self._profiles()

    def _profiles(self) -> dict[str, int]:
        """Which profile is DECODE (a chunk of one token) and which MIXED (longer chunks); sets max_slots (the
        decoding rows both take) and prefill_chunk (the longest chunk MIXED takes)."""
        engine, n = self.engine, self.layout.n_positions
        found, rows, chunk = {}, [], 0
        for i in range(engine.num_optimization_profiles):
            (r_lo, t_lo), _, (r_hi, t_hi) = engine.get_tensor_profile_shape(INPUT_IDS, i)
            (c_lo, ct_lo), _, (c_hi, ct_hi) = engine.get_tensor_profile_shape(PREFIX + INPUT_IDS, i)
            widths = [engine.get_tensor_profile_shape(p + ATTENTION_MASK, i) for p in ("", PREFIX)]
            if not (r_lo == 1 and t_lo <= 1 <= t_hi and c_lo <= 1 <= c_hi and ct_lo == 1
                    and all(lo[1] <= n <= hi[1] for lo, _, hi in widths)):
                continue
            name = DECODE if ct_hi == 1 else MIXED
            if name not in found:
                found[name] = i
                rows.append(r_hi)
                chunk = max(chunk, ct_hi if name == MIXED else 0)
        missing = [p for p in (DECODE, MIXED) if p not in found]
        if missing:
            raise InputError(f"{self.source}: no optimization profile fits {', '.join(missing)} (graphs/slot_decoder.py's "
                             f"slot_profiles gives the shapes: decode rows 1..max_slots beside a chunk, widths up to {n})")
        self.max_slots, self.prefill_chunk = min(rows), chunk
        return found

    def slot_cache(self, slots: int) -> TrtSlotCache:
        """`slots` sequences' cache on the device, for in-flight batching (runtime/batcher.py)."""
        if self._closed:
            raise InputError(f"{self.source}: this session is closed; load a new one")
        if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= self.max_slots:
            raise InputError(f"slots must be an integer in 1..{self.max_slots} (the most decoding rows this engine's "
                             f"profiles take), got {slots!r}")
        return TrtSlotCache(self, slots)

    # -- one sequence at a time, on a cache of one slot --------------------------------------------------
    def _prefill(self, ids: list[int]) -> np.ndarray:
        if self._own is None:
            self._own = TrtSlotCache(self, 1)
        out = []
        for start in range(0, len(ids), self.prefill_chunk):
            piece = ids[start:start + self.prefill_chunk]
            out.append(self._own.run((0, np.asarray([piece]), np.asarray([start + len(piece)])))[0][0])
        self._held = len(ids)
        return np.concatenate(out)

    def _decode(self, token: int) -> np.ndarray:
        n = self.layout.n_positions
        if self._own is None or self._held >= n:
            raise InputError(f"the context of {n} tokens is full: no token can follow")
        self._held += 1
        return self._own.run((0, np.asarray([[token]]), np.asarray([self._held])))[0][0, 0]

    def _release(self) -> None:  # SerialSession.close: under the session lock, once
        for cache in list(self._caches):
            cache.close()
        self._own = None
        self.engine = None  # after every context: TensorRT's order
        self._runtime = None

    __del__ = TrtSession.__del__  # a session nobody closed still gives its device memory back


class _Pair:
    """A device buffer and its page-locked host twin (a numpy view), of one shape and dtype."""

    def __init__(self, cache: TrtSlotCache, shape: tuple, dtype: np.dtype):
        nbytes = int(np.prod(shape)) * dtype.itemsize
        self.device = cache._alloc(nbytes)
        self.pinned = cache._alloc_host(nbytes)
        self.host = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(self.pinned)).view(dtype).reshape(shape)


class TrtSlotCache:
    """A fixed set of slots of the slot engine's cache on the device (see the module docstring). `run(group,
    [chunk])` as OrtSlotCache's: a group is (first, ids [rows, T], held [rows]); returns the logits [rows, T,
    vocab] float32 of each (None for no chunk). A lone group of one token a row from slot 0 is a decode step;
    any other lone group is one prompt's chunk (one row); beside a chunk, the group is decoding rows."""

    def __init__(self, owner: TrtSlotSession, slots: int):
        self.owner, self.cudart, self.layout, self.slots = owner, owner.cudart, owner.layout, slots
        self.max_chunk = owner.prefill_chunk
        self._device: list[int] = []
        self._pinned: list[int] = []
        self.graphs: dict[int, object] = {}
        self.stream: Any = None
        self.contexts: dict[str, object] = {}
        self.cuda_graph_error: str | None = None
        self.closed = False
        owner._caches.append(self)
        try:
            self._setup()
        except BaseException:
            self.close()
            raise

    # -- setup -------------------------------------------------------------------------------------------
    def _setup(self) -> None:
        rt, L, owner, dt = self.cudart, self.layout, self.owner, self.owner.dtypes
        n, V, S = L.n_positions, L.vocab_size, self.slots
        self.slot_bytes = L.n_head * n * L.head_dim * dt[L.past_names[0]].itemsize
        if self.slot_bytes % ALIGN:
            raise InputError(f"{owner.source}: one slot of the cache is {self.slot_bytes} bytes, not a multiple of "
                             f"{ALIGN}: TensorRT takes a tensor only at a {ALIGN}-byte aligned address")
        self.stream = int(_ok(rt, rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreate"))
        self.cache = [self._alloc((S + 1) * self.slot_bytes) for _ in L.past_names]  # the last slot: scratch
        self.ids, self.mask = _Pair(self, (S, 1), dt[INPUT_IDS]), _Pair(self, (S, n), dt[ATTENTION_MASK])
        self.logits = _Pair(self, (S, 1, V), dt[LOGITS])
        C = self.max_chunk
        self.chunk_ids, self.chunk_mask = _Pair(self, (1, C), dt[PREFIX + INPUT_IDS]), _Pair(self, (1, n), dt[PREFIX + ATTENTION_MASK])
        self.chunk_logits = _Pair(self, (1, C, V), dt[PREFIX + LOGITS])
        # the pad group of a step that needs only one: one token into the scratch slot, holding 1
        self.pad_ids, self.pad_mask = _Pair(self, (1, 1), dt[INPUT_IDS]), _Pair(self, (1, n), dt[ATTENTION_MASK])
        self.pad_ids.host[...] = PAD_ID
        self.pad_mask.host[...] = np.arange(n) < 1
        for pair in (self.pad_ids, self.pad_mask):
            self._copy(pair.device, pair.pinned, pair.host.nbytes, rt.cudaMemcpyKind.cudaMemcpyHostToDevice)
        for name, index in owner.profiles.items():
            ctx = owner.engine.create_execution_context()
            if not ctx.set_optimization_profile_async(index, self.stream):
                raise InputError(f"{owner.source}: cannot select optimization profile {index} ({name})")
            self.contexts[name] = ctx
        self.ids.host[...] = PAD_ID
        self.mask.host[...] = 1  # pad rows hold n_positions: they write the last position
        for rows in buckets(S):
            self._bind_decode(rows, addresses=True)
            if owner.capture and self.cuda_graph_error is None:
                self._capture(rows)
        if not owner.capture:
            self.cuda_graph_error = "not captured: capture=False (decode steps run uncaptured, on purpose)"
        for buffer in self.cache:  # after the warm-up runs, which wrote pads into the slots
            _ok(rt, rt.cudaMemsetAsync(buffer, 0, (S + 1) * self.slot_bytes, self.stream), "cudaMemsetAsync")
        self._sync()

    def _alloc(self, nbytes: int) -> int:
        ptr = int(_ok(self.cudart, self.cudart.cudaMalloc(max(nbytes, ALIGN)), "cudaMalloc"))
        self._device.append(ptr)
        return ptr

    def _alloc_host(self, nbytes: int) -> int:
        ptr = int(_ok(self.cudart, self.cudart.cudaMallocHost(max(nbytes, ALIGN)), "cudaMallocHost"))
        self._pinned.append(ptr)
        return ptr

    def _copy(self, dst: int, src: int, nbytes: int, kind) -> None:
        _ok(self.cudart, self.cudart.cudaMemcpyAsync(dst, src, nbytes, kind, self.stream), "cudaMemcpyAsync")

    def _sync(self) -> None:
        _ok(self.cudart, self.cudart.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")

    def _slot(self, buffer: int, slot: int) -> int:
        return buffer + slot * self.slot_bytes

    def _group(self, prefix: str, rows: int, tokens: int, first: int, ids: _Pair, mask: _Pair, logits: _Pair):
        """The shapes and addresses of one group: `rows` rows of `tokens` from slot `first`, in these buffers."""
        L = self.layout
        shapes = {prefix + INPUT_IDS: (rows, tokens),
                  prefix + ATTENTION_MASK: (rows, L.n_positions),
                  **{prefix + p: (rows, L.n_head, L.n_positions, L.head_dim) for p in L.past_names}}
        addresses = {prefix + INPUT_IDS: ids.device, prefix + ATTENTION_MASK: mask.device, prefix + LOGITS: logits.device}
        for past, present, buffer in zip(L.past_names, L.present_names, self.cache):
            addresses[prefix + past] = addresses[prefix + present] = self._slot(buffer, first)
        return shapes, addresses

    def _bind_decode(self, rows: int, addresses: bool) -> None:
        """The decode context bound for `rows` decoding rows from slot 0 beside the pad chunk (the shapes only,
        where the addresses, which never change, are bound already)."""
        shapes, where = self._group("", rows, 1, 0, self.ids, self.mask, self.logits)
        pad_shapes, pad_where = self._group(PREFIX, 1, 1, self.slots, self.pad_ids, self.pad_mask, self.chunk_logits)
        bind(self.contexts[DECODE], {**shapes, **pad_shapes}, {**where, **pad_where} if addresses else {})

    def _decode_work(self, rows: int) -> None:
        """A decode step's work on the stream: ids and mask in, the enqueue, logits out (what a graph captures)."""
        rt = self.cudart
        h2d, d2h = rt.cudaMemcpyKind.cudaMemcpyHostToDevice, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        for pair in (self.ids, self.mask):
            self._copy(pair.device, pair.pinned, pair.host[:rows].nbytes, h2d)
        enqueue(self.contexts[DECODE], self.stream)
        self._copy(self.logits.pinned, self.logits.device, self.logits.host[:rows].nbytes, d2h)

    def _capture(self, rows: int) -> None:
        """Run the bucket's step once (TensorRT finishes shape-dependent setup on the first enqueue), then
        capture it; on failure, every decode step runs uncaptured and cuda_graph_error says why."""
        self._decode_work(rows)
        self._sync()
        try:
            self.graphs[rows] = capture(self.cudart, self.stream, lambda: self._decode_work(rows))
        except CudaError as e:
            self.cuda_graph_error = f"bucket {rows}: {e}"
            self.cudart.cudaGetLastError()
            for g in self.graphs.values():
                self.cudart.cudaGraphExecDestroy(g)
            self.graphs = {}

    # -- steps -------------------------------------------------------------------------------------------
    def run(self, group: tuple, chunk: tuple | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        if self.closed:
            raise InputError(f"{self.owner.source}: this slot cache is closed (its batcher stopped, or its session closed)")
        for g in (group, chunk) if chunk is not None else (group,):
            self._check(*g)
        first, ids, _ = group
        if chunk is None and ids.shape[1] == 1 and first == 0:
            return self._decode_step(*group), None
        if chunk is None:
            if ids.shape[0] != 1:
                raise ValueError(f"run: a lone group of {ids.shape[0]} rows of {ids.shape[1]} tokens from slot {first}: "
                                 "decoding rows start at slot 0 with one token each, a prompt's chunk is one row")
            return self._mixed(None, group)[1], None
        if ids.shape[1] != 1 or chunk[1].shape[0] != 1:
            raise ValueError(f"run: beside a chunk, the group is decoding rows of one token each, and the chunk one "
                             f"row (got {ids.shape[1]} tokens a row, a chunk of {chunk[1].shape[0]} rows)")
        check_apart(group, chunk)
        logits, chunk_logits = self._mixed(group, chunk)
        assert logits is not None  # decoding rows were given
        return logits, chunk_logits

    def close(self) -> None:
        """Free the cache's device and page-locked memory, its graphs, contexts and stream (once)."""
        if self.closed:
            return
        self.closed = True
        rt = self.cudart
        if self.stream is not None:
            rt.cudaStreamSynchronize(self.stream)  # a step that raised part-way may have left work queued
        for g in self.graphs.values():
            rt.cudaGraphExecDestroy(g)
        self.graphs = {}
        for ptr in self._device:
            rt.cudaFree(ptr)
        for ptr in self._pinned:
            rt.cudaFreeHost(ptr)
        self._device, self._pinned, self.contexts = [], [], {}
        if self.stream is not None:
            rt.cudaStreamDestroy(self.stream)
            self.stream = None
        if self in self.owner._caches:
            self.owner._caches.remove(self)

    def _check(self, first: int, ids: np.ndarray, held: np.ndarray) -> None:
        rows, T = ids.shape
        if not (0 <= first and rows >= 1 and first + rows <= self.slots and held.shape == (rows,)
                and held.min() >= T and held.max() <= self.layout.n_positions):
            raise ValueError(f"run: rows {first}..{first + rows - 1} of {self.slots} slots, T {T}, held {held}")
        if T > self.max_chunk:
            raise ValueError(f"run: {T} tokens in one row; this engine takes at most {self.max_chunk} (its prefill chunk)")

    def _fill(self, ids: _Pair, mask: _Pair, tokens: np.ndarray, held: np.ndarray) -> None:
        rows, T = tokens.shape
        ids.host[:rows, :T] = tokens
        mask.host[:rows] = np.arange(self.layout.n_positions)[None, :] < held[:, None]

    def _decode_step(self, first: int, ids: np.ndarray, held: np.ndarray) -> np.ndarray:
        rows = ids.shape[0]
        bucket = next(b for b in buckets(self.slots) if b >= rows)
        self._fill(self.ids, self.mask, ids, held)
        self.ids.host[rows:bucket] = PAD_ID
        self.mask.host[rows:bucket] = 1  # pad rows: write the last position (see the module docstring)
        self._bind_decode(bucket, addresses=False)
        if bucket in self.graphs:
            _ok(self.cudart, self.cudart.cudaGraphLaunch(self.graphs[bucket], self.stream), "cudaGraphLaunch")
        else:
            self._decode_work(bucket)
        self._sync()
        return self.logits.host[:rows].astype(np.float32)

    def _mixed(self, group: tuple | None, chunk: tuple) -> tuple[np.ndarray | None, np.ndarray]:
        """Decoding rows (None: the pad row) beside a prompt's chunk, uncaptured on the mixed context."""
        rt = self.cudart
        h2d, d2h = rt.cudaMemcpyKind.cudaMemcpyHostToDevice, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        c_first, c_ids, c_held = chunk
        T = c_ids.shape[1]
        self._fill(self.chunk_ids, self.chunk_mask, c_ids, c_held)
        self._copy(self.chunk_ids.device, self.chunk_ids.pinned, self.chunk_ids.host.nbytes, h2d)
        self._copy(self.chunk_mask.device, self.chunk_mask.pinned, self.chunk_mask.host.nbytes, h2d)
        if group is None:
            rows, (shapes, where) = 0, self._group("", 1, 1, self.slots, self.pad_ids, self.pad_mask, self.logits)
        else:
            first, ids, held = group
            rows = ids.shape[0]
            self._fill(self.ids, self.mask, ids, held)
            for pair in (self.ids, self.mask):
                self._copy(pair.device, pair.pinned, pair.host[:rows].nbytes, h2d)
            shapes, where = self._group("", rows, 1, first, self.ids, self.mask, self.logits)
        c_shapes, c_where = self._group(PREFIX, 1, T, c_first, self.chunk_ids, self.chunk_mask, self.chunk_logits)
        ctx = self.contexts[MIXED]
        bind(ctx, {**shapes, **c_shapes}, {**where, **c_where})
        enqueue(ctx, self.stream)
        if rows:
            self._copy(self.logits.pinned, self.logits.device, self.logits.host[:rows].nbytes, d2h)
        self._copy(self.chunk_logits.pinned, self.chunk_logits.device, self.chunk_logits.host[:, :T].nbytes, d2h)
        self._sync()
        chunk_logits = self.chunk_logits.host.reshape(-1)[:T * self.layout.vocab_size].reshape(1, T, -1)
        return (self.logits.host[:rows].astype(np.float32) if rows else None), chunk_logits.astype(np.float32)

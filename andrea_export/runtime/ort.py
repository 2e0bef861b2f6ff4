"""ONNX Runtime backend: the KV-cache decoder graph through IO binding.

Each step binds the previous step's `present.*` OrtValues as this step's `past_key_values.*` inputs, and
asks ONNX Runtime to allocate the new `present.*` on the execution device: the cache never leaves the
device between steps (host memory with the CPU provider, GPU memory with the CUDA provider). Only the
token ids and the mask go in and the logits come out through host memory.

With the in-place decoder (graphs/inplace_decoder.py, `layout.shared`) a call instead allocates one buffer per
layer and kind, as long as the call needs (prompt + new tokens), and binds it as both `past_key_values.*`
and `present.*` of every step: the graph writes each new token's keys and values into it where they
belong and nothing is copied. That graph pads rows on the right; `_InplaceSteps` converts the base's
left-padded rows.

Threads: one OrtSession serves many threads in parallel. Every call keeps its own cache (`_OrtSteps`,
`_InplaceSteps`) and its own IOBinding (a fresh one per step; the in-place steps one per call); ONNX Runtime guarantees that `InferenceSession::Run` may be called from
several threads at once on one session (the Python `run_with_iobinding` releases the GIL while it runs),
as long as no two runs share a binding or its buffers. (ONNX Runtime's own CUDA graphs would break this;
they are not enabled here.)
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np

from ..config import ModelConfig
from ..errors import InputError
from ..graphs.layout import KVLayout
from ..graphs.two_groups import PREFIX as CHUNK
from ..names import ATTENTION_MASK, INPUT_IDS, LOGITS
from .base import Session, SlotCache, Steps, check_apart


def _providers(requested: list[str] | None, layout: KVLayout, source) -> list[str]:
    """The providers a session gets: the requested ones, else CUDA (when present) then CPU. The in-place
    graph runs on the CPU provider only: ONNX Runtime's CUDA GroupQueryAttention has no float32 kernels,
    and a node that falls back to the CPU would update a copy of the device buffer, not the buffer."""
    import onnxruntime as ort

    if layout.shared:
        if requested and list(requested) != ["CPUExecutionProvider"]:
            raise InputError(f"{source}: the in-place decoder runs on ONNX Runtime's CPU provider only (asked for "
                             f"{', '.join(requested)}); for CUDA load the build's decoder.onnx")
        return ["CPUExecutionProvider"]
    if requested:
        return list(requested)
    available = ort.get_available_providers()
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]


class OrtSession(Session):
    backend = "onnxruntime"

    def __init__(
        self,
        onnx_path: str | Path,
        cfg: ModelConfig,
        layout: KVLayout,
        *,
        providers: list[str] | None = None,
        intra_op_threads: int | None = None,
        session=None,
    ):
        """`session`: an InferenceSession of `onnx_path` made by the caller (its own session options, e.g. the
        benchmark's), used as it is; None: load the graph here."""
        import onnxruntime as ort

        super().__init__(cfg, layout, str(onnx_path))
        providers = _providers(providers, layout, onnx_path)
        if session is None:
            opts = ort.SessionOptions()
            opts.log_severity_level = 3
            if intra_op_threads:
                opts.intra_op_num_threads = intra_op_threads
            session = ort.InferenceSession(str(onnx_path), opts, providers=providers)
        self.session = session
        on_gpu = self.session.get_providers()[0] == "CUDAExecutionProvider"
        self.device = ("cuda", 0) if on_gpu else ("cpu", 0)

    def close(self) -> None:
        """Let go of the InferenceSession: ONNX Runtime frees it once the calls in flight (each holds it)
        have ended; a later call is refused."""
        self.session = None

    def _steps(self, capacity: int | None = None):
        if self.session is None:
            raise InputError(f"{self.source}: this session is closed; load a new one")
        if self.layout.shared:
            return contextlib.nullcontext(_InplaceSteps(self, capacity or self.layout.n_positions))
        return contextlib.nullcontext(_OrtSteps(self))


    def slot_cache(self, slots: int) -> SlotCache:
        """`slots` sequences' cache for in-flight batching (runtime/batcher.py): needs the in-place decoder."""
        if self.session is None:
            raise InputError(f"{self.source}: this session is closed; load a new one")
        if not self.layout.shared:
            raise InputError(f"{self.source}: in-flight batching needs the in-place decoder (decoder.inplace.onnx: "
                             "a build's CPU decoder; load the build folder with backend 'onnxruntime' on the CPU)")
        return OrtSlotCache(self, slots)

    def _two_group_session(self):
        """An InferenceSession of this session's in-place graph made two-group (graphs/two_groups.py), with
        this session's options, its weights read from the file's own folder (checked as every reader does)."""
        import onnx_ir as ir
        import onnxruntime as ort

        from ..errors import AndreaExportError
        from ..graphs.external_data import external_data_files
        from ..graphs.two_groups import two_group_decoder

        path = Path(self.source)
        try:
            external_data_files(path)
            graph = ir.to_proto(two_group_decoder(ir.load(path))).SerializeToString()
        except AndreaExportError as e:
            raise InputError(str(e)) from None
        mine, opts = self.session.get_session_options(), ort.SessionOptions()
        opts.intra_op_num_threads, opts.inter_op_num_threads = mine.intra_op_num_threads, mine.inter_op_num_threads
        opts.log_severity_level, opts.graph_optimization_level = mine.log_severity_level, mine.graph_optimization_level
        opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(path.parent))
        return ort.InferenceSession(graph, opts, providers=["CPUExecutionProvider"])


class OrtSlotCache:
    """A fixed set of slots of the in-place cache, each holding one sequence, for in-flight batching: one host
    buffer [slots, n_head, n_positions, head_dim] per layer and kind, run through the owner's session or,
    when the decoding rows and a joining prompt's chunk share a step, through a session of its own on the
    two-group graph (graphs/two_groups.py), which reads every weight once for both.

    `run(group, [chunk])`: a group is (first, ids, held): the slots `first` .. `first + len(ids) - 1`, their
    new tokens `ids` [rows, T] (right-padded) and the tokens each holds after the run. Batch is the leading
    axis, so a group's slots are one contiguous block of every buffer, bound as both past and present by
    pointer. A lone group runs on the one-group graph: the two-group graph costs a step of 1-16 rows
    2-8 ms more (ANDREA-120M fp32, 2 cores; its other group cannot be empty: ONNX Runtime's CPU
    GroupQueryAttention dies on a batch of 0). A sequence's logits are the same, bit for bit, whatever shares
    its run (fp32 on ONNX Runtime 1.32's CPU kernels; the batcher's tests hold it to that; MatMulNBits
    graphs agree to rounding, their sums following the run's row count as they did before)."""

    def __init__(self, owner: OrtSession, slots: int):
        if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= 256:
            raise InputError(f"slots must be an integer in 1..256, got {slots!r}")
        L = owner.layout
        self.owner, self.layout, self.slots = owner, L, slots
        self.max_chunk = L.n_positions
        self.two_groups = owner._two_group_session()
        shape = (slots, L.n_head, L.n_positions, L.head_dim)
        # Written now, so that the pages are the process's from the start: its memory is known when it
        # starts serving, and no request pays for first touches (left untouched, the first runs into fresh
        # slots took 160-330 ms against 20-60 on ANDREA-120M fp32, 2 cores).
        self.buffers = [np.empty(shape, dtype=np.dtype(L.cache_dtype)) for _ in L.past_names]
        for buffer in self.buffers:
            buffer.fill(0)  # not np.zeros: its pages stay the kernel's until first written
        self.slot_bytes = self.buffers[0][0].nbytes
        self.closed = False

    def run(self, group: tuple, chunk: tuple | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """One run of `group` and, beside it, `chunk` (each (first, ids, held), see the class) -> the logits
        [rows, T, vocab] of each (None for no chunk). Where the two share a slot, one of them must be a pad
        whose write lies past every position the other holds (the batcher's decoding rows give a slot whose
        prompt is in the chunk a pad at the context's last position)."""
        if self.closed:
            raise InputError(f"{self.owner.source}: this slot cache is closed (its batcher stopped); make a new one")
        session = self.owner.session if chunk is None else self.two_groups
        if session is None:
            raise InputError(f"{self.owner.source}: this session is closed; load a new one")
        for g in (group, chunk) if chunk is not None else (group,):
            self._check(*g)
        binding = session.io_binding()
        logits = self._bind(binding, "", *group)
        if chunk is None:
            session.run_with_iobinding(binding)
            return logits, None
        check_apart(group, chunk)
        chunk_logits = self._bind(binding, CHUNK, *chunk)
        session.run_with_iobinding(binding)
        return logits, chunk_logits

    def close(self) -> None:
        """Let go of the cache's buffers and the two-group session (the owner's stays the owner's)."""
        self.two_groups, self.buffers, self.closed = None, [], True

    def _check(self, first: int, ids: np.ndarray, held: np.ndarray) -> None:
        rows = ids.shape[0]
        if not (0 <= first and rows >= 1 and first + rows <= self.slots and held.shape == (rows,)
                and held.min() >= ids.shape[1] and held.max() <= self.layout.n_positions):
            raise ValueError(f"run: rows {first}..{first + rows - 1} of {self.slots} slots, T {ids.shape[1]}, held {held}")

    def _bind(self, binding, prefix: str, first: int, ids: np.ndarray, held: np.ndarray) -> np.ndarray:
        L = self.layout
        logits = _bind_step(binding, ids, held, L.vocab_size, prefix)
        shape = [ids.shape[0], L.n_head, L.n_positions, L.head_dim]
        dtype = np.dtype(L.cache_dtype).type
        for past, present, buffer in zip(L.past_names, L.present_names, self.buffers):
            ptr = buffer.ctypes.data + first * self.slot_bytes
            binding.bind_input(prefix + past, "cpu", 0, dtype, shape, ptr)
            binding.bind_output(prefix + present, "cpu", 0, dtype, shape, ptr)
        return logits


class _OrtSteps(Steps):
    """One call's cache: the `present.*` OrtValues of its last step, where ONNX Runtime allocated them."""

    def __init__(self, owner: OrtSession):
        self.session, self.layout, self.device = owner.session, owner.layout, owner.device
        self.past: list = []  # OrtValues, layout.past_names order

    def prefill(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        import onnxruntime as ort

        shape = [ids.shape[0], self.layout.n_head, 0, self.layout.head_dim]
        dtype = np.dtype(self.layout.cache_dtype)
        self.past = [ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, *self.device) for _ in self.layout.past_names]
        return self._run(ids, mask)

    def decode(self, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return self._run(tokens[:, None], mask)[:, -1]

    def _run(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """One step: `ids` [B, T] after the cache, `mask` [B, P + T]; updates the cache, returns logits [B, T, vocab]."""
        ids, mask = np.ascontiguousarray(ids, dtype=np.int64), np.ascontiguousarray(mask, dtype=np.int64)
        binding = self.session.io_binding()  # this step's own: bindings are never shared between runs
        binding.bind_cpu_input(INPUT_IDS, ids)
        binding.bind_cpu_input(ATTENTION_MASK, mask)
        for name, value in zip(self.layout.past_names, self.past):
            binding.bind_ortvalue_input(name, value)
        binding.bind_output(LOGITS, "cpu")
        for name in self.layout.present_names:
            binding.bind_output(name, *self.device)  # allocated by ORT on the device, kept for the next step
        self.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        self.past = outputs[1:]
        return outputs[0].numpy()


class _InplaceSteps(Steps):
    """One call's cache for the in-place graph: a buffer [B, n_head, capacity, head_dim] per layer and kind,
    bound as past and present of every step, and the number of tokens each row holds."""

    def __init__(self, owner: OrtSession, capacity: int):
        self.session, self.layout, self.device = owner.session, owner.layout, owner.device
        # the slot decoder's buffer is n_positions long by its graph (slot_decoder.py)
        self.capacity = self.layout.n_positions if self.layout.static else min(capacity, self.layout.n_positions)
        self.buffers: list = []
        self.held = np.zeros(0, dtype=np.int64)

    def prefill(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        import onnxruntime as ort

        B, T = ids.shape
        self.held = mask.sum(axis=1).astype(np.int64)
        if not np.array_equal(mask, np.arange(T)[None, :] >= T - self.held[:, None]):
            raise ValueError("prefill: each row's mask must be 0s then 1s (left padding)")
        if T > self.capacity:
            raise ValueError(f"prefill: {T} tokens do not fit a cache of {self.capacity}")
        shape = [B, self.layout.n_head, self.capacity, self.layout.head_dim]
        dtype = np.dtype(self.layout.cache_dtype)
        # GroupQueryAttention reads only each row's filled part: its buffers need not be written first. The slot
        # decoder's attention reads the whole buffer under a mask, where an unwritten NaN would give 0 * NaN.
        self.buffers = [ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, *self.device) for _ in self.layout.past_names]
        if self.layout.static:
            for buffer in self.buffers:
                buffer.update_inplace(np.zeros(shape, dtype=dtype))
        self.binding = self.session.io_binding()  # this call's own; the buffers stay bound for all its steps
        for past, present, buffer in zip(self.layout.past_names, self.layout.present_names, self.buffers):
            self.binding.bind_ortvalue_input(past, buffer)
            self.binding.bind_ortvalue_output(present, buffer)
        shift = T - self.held  # left -> right padding: each row's tokens move to its start
        right = np.stack([np.roll(row, -k) for row, k in zip(ids, shift)])
        logits = self._run(right, self.held)
        return np.stack([np.roll(row, k, axis=0) for row, k in zip(logits, shift)])  # back to the caller's columns

    def decode(self, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
        held = self.held + 1
        if held.max() > self.capacity:
            raise ValueError(f"decode: the cache holds {self.capacity} tokens per row; this step needs {held.max()}")
        logits = self._run(np.asarray(tokens, dtype=np.int64)[:, None], held)
        self.held = held
        return logits[:, -1]

    def _run(self, ids: np.ndarray, held: np.ndarray) -> np.ndarray:
        """`ids` [B, T] (right-padded), each row holding `held` tokens after this step -> logits [B, T, vocab]."""
        logits = _bind_step(self.binding, ids, held, self.layout.vocab_size)
        self.session.run_with_iobinding(self.binding)
        return logits


def _bind_step(binding, ids: np.ndarray, held: np.ndarray, vocab_size: int, prefix: str = "") -> np.ndarray:
    """Bind an in-place step's ids [B, T] (right-padded) and mask (each row holds `held` tokens after it) as
    inputs (rebinding a name replaces its previous array) and a fresh logits array as the output, which
    ONNX Runtime writes; returns that array. `prefix`: the two-group graph's second group's names."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    mask = (np.arange(held.max())[None, :] < held[:, None]).astype(np.int64)
    logits = np.empty((*ids.shape, vocab_size), dtype=np.float32)
    binding.bind_cpu_input(prefix + INPUT_IDS, ids)
    binding.bind_cpu_input(prefix + ATTENTION_MASK, mask)
    binding.bind_output(prefix + LOGITS, "cpu", element_type=np.float32, shape=logits.shape, buffer_ptr=logits.ctypes.data)
    return logits

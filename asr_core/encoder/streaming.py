"""Batched cache-aware streaming encoder with a device-resident slot pool.

Theory of operation. Every stream owns a slot. Its caches are rows of a few preallocated batched
arrays (the pool), which double when full:

* K|V: a ring of Lc rows per slot in `kv` (layers, 2H, 1 + cap*Lc, dh), head-major, holding the
  *projected* keys and values of the last Lc encoder frames; frame a of slot s lives in row
  1 + s*Lc + a % Lc of every (layer, K|V, head) plane. A step gathers each row's Lc cached frames
  oldest-first (one take for all layers, landing in the (K|V, H, B, Lc, dh) layout the attention's
  GEMMs read as they are) and writes only its T new frames back, so no cache is ever shifted in the
  pool. Where one array would pass 2**31 values (`max_streams`), the layers are split into groups
  of consecutive layers, one array each (`kv_groups`): a take and a scatter per group.
* conv: the last K-1 GLU outputs per layer, `conv` (layers, 1 + cap, K-1, D).
* subsampling: each strided stage's last input row, `sub[i]` (1 + cap, F_i[, C]).

The K|V and conv pools hold their rows' bytes as 4-byte words (`_words`), taken as 8-byte ones
(`_take_values`): a scatter moves half as many elements as f16 values, a take a quarter.

Row 0 of every pool is zeros and is never written: a fresh stream gathers it for slots that hold no
frame yet (they are masked anyway; zeros keep them finite).

`step(rows)` groups rows by subsampling shape (mel frames, first, last), runs the conformer stack
once per padded length T (rows of different lookaheads, languages, first/later chunks, short last
chunks and the two chunks of a flush share it; only a flush at a stream's first chunk has a call of its
own), and evaluates everything with one `mx.eval`.
The pool writes of a step are applied lazily at the start of the next one: an MLX scatter can reuse
the pool's buffer in place only when no gather of the same graph still references it, and deferring
the writes guarantees exactly that.

Not thread-safe: one thread owns the encoder (the engine's MLX thread).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import heapq
import itertools
import logging
import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import mlx.core as mx
import numpy as np

from asr_core import hostcopy
from asr_core.bundle import PRECISIONS, EncoderConfig
from asr_core.encoder.geometry import chunk_frames, encoder_frames, first_chunk_frames
from asr_core.encoder.layers import (
    EncoderParams,
    build_params,
    chain_indices,
    encoder_stack,
    offline_forward,
    subsample,
)
from asr_core.errors import EngineFullError
from asr_core.frontend import flush_extra_chunks
from asr_core.quant import Linear

logger = logging.getLogger(__name__)

_MAX_POOL_ELEMENTS = 2**31 - 1  # see StreamingEncoder.max_streams


@dataclass(frozen=True, slots=True)
class ChunkInput:
    """One stream's next chunk: `mel` (n, n_mels) float32 log-mel frames of slot `slot`.

    `flush`: a non-committing step: `mel` (the next chunk's size, or that plus whole later chunks)
    is encoded as the stream's next chunks, each attending as in streaming (its own frames, those
    before it), reading the slot's caches but writing none and not advancing the stream, so the
    real chunks that later cover the same audio encode exactly as if the flush had never happened.
    The engine flushes the pending partial chunk, padded with silence, when the caller stopped
    speaking. An empty flush is a no-op.
    """

    slot: int
    mel: np.ndarray
    is_last: bool = False
    flush: bool = False


@dataclass(slots=True)
class _Stream:
    prompt_id: int
    lookahead: int
    frames: int = 0  # encoder frames produced so far
    chunks: int = 0
    finished: bool = False


@dataclass(frozen=True, slots=True)
class _Row:
    index: int  # position in the caller's rows
    slot: int
    stream: _Stream
    mel: np.ndarray
    first: bool
    last: bool
    T: int
    flush: bool = False
    ahead: int = 0  # encoder frames between the stream's last committed frame and this row's first
    follows: bool = False  # continues the row just before it in the step (a flush's second chunk)


class StreamingEncoder:
    """The MLX encoder: slot pool + batched `step` + `forward_offline` (see the module docstring)."""

    def __init__(
        self,
        weights: Mapping[str, Linear],
        cfg: EncoderConfig,
        dtype: str | mx.Dtype = "f32",
        *,
        capacity: int = 8,
        compile: bool | None = None,
        pad_batches: bool | None = None,
        unpack: bool | None = None,
        array_exp: bool | None = None,
        kv_groups: int = 1,
    ) -> None:
        """Defaults depend on the device.

        `compile` (None: on a GPU only): mx.compile the step, which fuses elementwise chains but, on
        the CPU, costs a C++ compile per new shape and saves little next to the weight-streaming
        matmuls. `pad_batches` (None: when compiled): pad each call's rows to a few bucket sizes so a
        varying batch does not trace anew. `unpack` (None: on the CPU only): dequantize packed
        weights once instead of multiplying with the packed codes; MLX's CPU quantized matmul is not
        BLAS-backed (docs/quantization.md: a full-size step at B=1 took 3x as long packed as dense),
        while a GPU keeps the codes packed (the point of them: fewer bytes to hold and to read).
        `array_exp` (None: an x86-64 CPU with g++): sigmoid and softmax as fused array ops
        (`expmath`). `kv_groups`: the K|V pool's arrays (a divisor of the layers; `warmup` adds
        groups where the streams expected need them). Every option gives the same frames within float
        rounding."""
        on_gpu = mx.default_device() == mx.gpu
        self.cfg = cfg
        self.dtype: mx.Dtype = PRECISIONS[dtype] if isinstance(dtype, str) else dtype
        self.unpacked = not on_gpu if unpack is None else unpack
        self.params: EncoderParams = build_params(weights, cfg, self.dtype, self.unpacked, array_exp)
        self.compiled = on_gpu if compile is None else compile
        self.pad_batches = self.compiled if pad_batches is None else pad_batches
        self._Lc = cfg.left_context_frames
        self._streams: dict[int, _Stream] = {}
        self._free: list[int] = []
        self._capacity = 0
        self._pending: list[tuple[int, mx.array, mx.array]] = []  # (pool id, row indices, values)
        self._uploads = _Uploads()  # where a step's inputs are built, kept from step to step
        self._sub_fns: dict[tuple[bool, bool, bool, bool], Callable[..., tuple[mx.array, ...]]] = {}
        self._stack_fns: dict[tuple[int, bool], Callable[..., tuple[mx.array, ...]]] = {}
        # After `warmup`: the call shapes it traced. A compiled call on any other shape (a first chunk
        # that is also the last, a lookahead not warmed) would trace anew, and on a GPU compile kernels
        # for seconds with every stream waiting; such rare calls run uncompiled instead.
        self._traced: set[tuple[object, ...]] | None = None
        self._tracing: set[tuple[object, ...]] | None = None
        # Steps and the compiled-function calls they made: "sub", "stack", and "untraced" (calls that
        # ran uncompiled for want of a warmed shape). Read by the engine's summary.
        self.calls: Counter[str] = Counter()
        # Where the steps' wall time went: "plan" (checking the rows, applying the last step's pool
        # writes), "graph" (the calls that build the lazy graph; both on this thread under the
        # interpreter lock), "eval" (the one `mx.eval`: the kernels' launch and run, the lock released),
        # "copy" (frames to the host).
        self.seconds = dict.fromkeys(("plan", "graph", "eval", "copy"), 0.0)
        self._sizes: dict[tuple[int, bool], int] = {}  # (lookahead, first) -> mel frames
        self._frames: dict[tuple[int, bool, bool], int] = {}  # (mel frames, first, last) -> T
        D, L, K = cfg.hidden_size, cfg.num_hidden_layers, cfg.conv_kernel_size
        freqs = cfg.subsampling_freqs()
        H = cfg.num_attention_heads
        self._word, words = _words(self.dtype, D // H)  # per head's row; H times that per D values
        if kv_groups < 1 or L % kv_groups:
            raise ValueError(f"kv_groups {kv_groups} does not divide the {L} layers")
        # The pools: the K|V groups' ring rows, conv, then the subsampling stages'. The slot (ring row)
        # axis of each: `_slot_axis`; kv keeps the layer and (K|V, head) planes in front of it, conv
        # the layer axis.
        self._kv_groups = kv_groups
        self._pools: list[mx.array] = [
            *[mx.zeros((L // kv_groups, 2 * H, 1, words), dtype=self._word) for _ in range(kv_groups)],
            mx.zeros((L, 1, K - 1, H * words), dtype=self._word),  # conv
            mx.zeros((1, freqs[0]), dtype=self.dtype),  # subsampling stage 0 (single channel)
            *[mx.zeros((1, f, cfg.subsampling_conv_channels), dtype=self.dtype) for f in freqs[1:-1]],
        ]
        self._grow(max(1, capacity))

    # ---------------------------------------------------------------------------------------------
    # slot pool

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def n_active(self) -> int:
        return len(self._streams)

    @property
    def kv_groups(self) -> int:
        return self._kv_groups

    @property
    def max_streams(self) -> int | None:
        """On a GPU, the most slots the pools may hold: every pool array stays below 2**31 elements.

        Some of MLX's GPU kernels address an array with 32-bit offsets; a K|V pool array holds (layers
        of its group, 1 + slots * Lc, 2D) values, and one for all layers at full size passes 2**31 of
        them at 781 slots, where CUDA failed with "an illegal memory access" (docs/benchmarks.md).
        Counted in values, the most elements of any view of the pool (it stores them as 4-byte words,
        taken as 8-byte ones). None on the CPU."""
        return pool_stream_limit(self.cfg, self._kv_groups) if mx.default_device() == mx.gpu else None

    def alloc(self, prompt_id: int, lookahead: int) -> int:
        """A slot for a new stream with language prompt `prompt_id` and `lookahead` (frames)."""
        if not 0 <= prompt_id < self.cfg.num_prompts:
            raise ValueError(f"prompt id {prompt_id} outside [0, {self.cfg.num_prompts})")
        if lookahead not in self.cfg.supported_lookaheads:
            raise ValueError(f"lookahead {lookahead} not in {sorted(self.cfg.supported_lookaheads)}")
        if not self._free:
            limit = self.max_streams
            if limit is not None and self._capacity >= limit:
                raise EngineFullError(f"the encoder's pools hold their most streams ({limit})")
            self._grow(2 * self._capacity if limit is None else min(limit, 2 * self._capacity))
        slot = heapq.heappop(self._free)
        self._streams[slot] = _Stream(prompt_id, lookahead)
        return slot

    def release(self, slot: int) -> None:
        """Free `slot` (its stream may be finished or not). Its stale caches are never read again."""
        if self._streams.pop(slot, None) is None:
            raise ValueError(f"slot {slot} is not allocated")
        heapq.heappush(self._free, slot)

    def _grow(self, capacity: int) -> None:
        self._flush_pending()
        add = capacity - self._capacity
        for i, pool in enumerate(self._pools):
            axis = self._slot_axis(i)
            shape = list(pool.shape)
            shape[axis] = add * self._Lc if i < self._kv_groups else add
            self._pools[i] = mx.concatenate([pool, mx.zeros(shape, dtype=pool.dtype)], axis=axis)
        mx.eval(self._pools)
        for slot in range(self._capacity, capacity):
            heapq.heappush(self._free, slot)
        self._capacity = capacity

    def _regroup(self, groups: int) -> None:
        """Split the K|V pool into `groups` arrays of consecutive layers (the caches they hold kept).
        The stack calls take the groups as inputs: traced again at their next call."""
        if groups == self._kv_groups:
            return
        self._flush_pending()
        G = self._kv_groups
        kv = mx.concatenate(self._pools[:G]) if G > 1 else self._pools[0]
        parts = [mx.contiguous(part) for part in mx.split(kv, groups)]
        del kv
        self._pools[:G] = parts
        mx.eval(self._pools)
        self._kv_groups = groups
        self._stack_fns.clear()

    def _slot_axis(self, pool: int) -> int:
        """The slot (ring row) axis of pool `pool`: 2 in a K|V group (after the layer and K|V-head
        planes), 1 in the conv pool (after the layer), 0 in the subsampling pools."""
        return 2 if pool < self._kv_groups else 1 if pool == self._kv_groups else 0

    def _flush_pending(self) -> None:
        # Each scatter consumes the previous pool array (refcount 1), so MLX updates it in place.
        for pool, idx, values in self._pending:
            self._pools[pool][(slice(None),) * self._slot_axis(pool) + (idx,)] = values
        self._pending.clear()

    # ---------------------------------------------------------------------------------------------
    # streaming

    def step(self, rows: Sequence[ChunkInput], *, dot_path: str | None = None) -> list[np.ndarray]:
        """Encode one chunk for each row; returns each row's joiner frames (T_i, J) float32, in order.

        A stream's first chunk has first_chunk_frames(r) mel frames, later chunks chunk_frames(r);
        the chunk with `is_last` may be shorter (even empty) and ends the stream. `dot_path` writes
        the step's lazy graph (what one `mx.eval` runs) in DOT format, for counting kernels.
        """
        t0 = time.perf_counter()
        planned = self._chain_flushes(self._plan(rows))
        self._flush_pending()
        self.calls["step"] += 1
        tp = time.perf_counter()
        pieces: list[list[np.ndarray]] = [[] for _ in rows]
        J = self.cfg.output_size

        # Subsampling calls by chunk length: a later chunk that ends its stream short rides in the
        # regular call of its length, its mel zero-padded and each stage masked behind its real rows
        # (`subsample`'s `lengths`), so it runs the call the warm-up compiled instead of one of its own
        # length. Stack calls by padded length: a row's own chunk length, or more for a flush of several
        # chunks at a stream's first (`_chain_flushes` splits the others). A short last chunk rides in
        # its stream's regular stack call too, padded behind its frames and masked (`_stack_meta`);
        # the causal convolution never reads the padding, and no query sees it.
        # The host builds every call's inputs first; they reach the device in one array (`_Uploads`).
        up = self._uploads
        up.start()
        subs = [_SubCall(key, group) for key, group in _group(planned, self._sub_key).items() if key[0]]
        for s in subs:
            n, first, last = s.key
            group, B, Bp = s.group, len(s.group), self._bucket(len(s.group))
            mel_in, mel = up.empty((Bp, n, self.cfg.n_mels))  # filled before the next add
            # Each row's frames, zeros after a short row's and in the padding rows; both keep the
            # interpreter lock (hostcopy).
            for k, r in enumerate(group):
                m = r.mel.shape[0]
                hostcopy.put(mel[k, :m], r.mel)
                if m < n:
                    hostcopy.zero(mel[k, m:])
            hostcopy.zero(mel[B:])
            slots = np.zeros(Bp, np.int32)  # padding rows gather the zero row
            slots[:B] = [1 + r.slot for r in group]
            s.chained = not first and (self.compiled or any(r.follows for r in group))
            # Compiled, every later-chunk call takes the rows' lengths (one traced signature).
            s.masked = not first and (self.compiled or any(r.mel.shape[0] < n for r in group))
            s.inputs = [mel_in, up.add(slots)]
            if s.masked:
                s.inputs.append(up.add(_mel_lengths(group, Bp, n)))
            if s.chained:
                s.inputs += [up.add(a) for a in _parents(group, Bp)]
            # Flush rows write no cache; a last chunk's are never read again (its slot is released).
            keep = [k for k, r in enumerate(group) if not (r.flush or r.last)]
            if not last and len(keep) == Bp:
                s.writes = (s.inputs[1], None)
            elif not last and keep:
                s.writes = (up.add(slots[keep]), up.add(np.array(keep, np.int32)))

        stacks: dict[int, _StackCall] = {}
        for i, s in enumerate(subs):
            for T_pad in sorted({_padded_length(r) for r in s.group}):
                part = [k for k, r in enumerate(s.group) if _padded_length(r) == T_pad]
                call = stacks.setdefault(T_pad, _StackCall(T_pad))
                take = None if len(part) == len(s.group) else up.add(np.array(part, np.int32))
                call.parts.append((i, take))
                call.group += [s.group[k] for k in part]
        for call in stacks.values():
            group, T = call.group, call.T
            B, Bp = len(group), self._bucket(len(group))
            call.meta = [up.add(a) for a in self._stack_meta(group, T, Bp)]
            call.chained = self.compiled or any(r.follows for r in group)
            if call.chained:
                parent, follows = _parents(group, Bp)
                conv_ctx = chain_indices(parent, T, self.cfg.conv_kernel_size)
                call.links = [up.add(parent), up.add(follows), up.add(conv_ctx)]
            keep = [k for k, r in enumerate(group) if not (r.flush or r.last)]
            call.keep = None if len(keep) in (0, B) else up.add(np.array(keep, np.int32))
            call.commits = bool(keep)
        up.send()

        G = self._kv_groups
        xs_by_sub: list[mx.array] = []
        for s in subs:
            n, first, last = s.key
            B, Bp = len(s.group), self._bucket(len(s.group))
            sub = self._sub_fn(first, last, s.chained, s.masked, ("sub", first, last, Bp, n))
            x, *stage_rows = sub(*(up[h] for h in s.inputs), *self._pools[G + 1 :])
            self.calls["sub"] += 1
            if s.writes is not None:
                slots_h, keep_h = s.writes
                if keep_h is None:
                    self._pending += [(G + 1 + i, up[slots_h], row) for i, row in enumerate(stage_rows)]
                else:
                    idx, rows_h = up[keep_h], up[slots_h]
                    self._pending += [
                        (G + 1 + i, rows_h, mx.take(row, idx, axis=0)) for i, row in enumerate(stage_rows)
                    ]
            xs_by_sub.append(x[:B] if Bp > B else x)

        results: list[tuple[list[_Row], mx.array]] = []
        for call in stacks.values():
            group, T = call.group, call.T
            B, Bp = len(group), self._bucket(len(group))
            xs = []
            for i, take in call.parts:
                rows_x = xs_by_sub[i] if take is None else mx.take(xs_by_sub[i], up[take], axis=0)
                if rows_x.shape[1] < T:
                    rows_x = mx.pad(rows_x, [(0, 0), (0, T - rows_x.shape[1]), (0, 0)])
                xs.append(rows_x)
            if Bp > B:
                xs.append(mx.zeros((Bp - B, T, self.cfg.hidden_size), dtype=self.dtype))
            x = xs[0] if len(xs) == 1 else mx.concatenate(xs)
            meta = [up[h] for h in call.meta]
            links = [up[h] for h in call.links]
            frames, kv_new, conv_new = self._stack_fn(T, call.chained, ("stack", T, Bp))(
                x, tuple(self._pools[:G]), self._pools[G], *meta[:4], *links
            )
            self.calls["stack"] += 1
            if Bp > B:
                frames, kv_new, conv_new = frames[:B], kv_new[:, :, :, :B], conv_new[:, :B]
            if call.commits:
                if call.keep is not None:
                    idx = up[call.keep]
                    kv_new, conv_new = mx.take(kv_new, idx, axis=3), mx.take(conv_new, idx, axis=1)
                # (layers, 2, H, B, T, dh) -> the pools' (layers, 2H, B*T, words), a slice per group
                L, _, H, Bk, _, dh = kv_new.shape
                words = kv_new.reshape(L, 2 * H, Bk * T, dh).view(self._word)
                Lg = L // G
                kv_write = _ring_writes(meta[4], T, self._Lc)
                self._pending += [(g, kv_write, words[g * Lg : (g + 1) * Lg]) for g in range(G)]
                self._pending.append((G, meta[5], conv_new.view(self._word)))
            results.append((group, frames))

        if dot_path is not None:
            mx.export_to_dot(dot_path, *[f for _, f in results], *self._pools)
        t1 = time.perf_counter()
        mx.eval([f for _, f in results], self._pools)
        t2 = time.perf_counter()
        for group, frames in results:
            # The frames' host buffer (no copy), copied holding the interpreter lock (`hostcopy`).
            host = hostcopy.copy(np.asarray(frames))
            for k, r in enumerate(group):
                pieces[r.index].append(host[k, : r.T])
        t3 = time.perf_counter()
        for phase, dt in (("plan", tp - t0), ("graph", t1 - tp), ("eval", t2 - t1), ("copy", t3 - t2)):
            self.seconds[phase] += dt
        for r in planned:
            if r.flush:
                continue
            r.stream.frames += r.T
            r.stream.chunks += 1
            r.stream.finished = r.last
        empty = np.zeros((0, J), np.float32)
        return [(p[0] if len(p) == 1 else np.concatenate(p)) if p else empty for p in pieces]

    def _sub_key(self, r: _Row) -> tuple[int, bool, bool]:
        """The subsampling call a row runs in: (mel rows, first, last). A later chunk that ends its
        stream joins the regular call of its lookahead (padded; see `step`)."""
        n = r.mel.shape[0]
        if r.last and not r.first and n:
            return self._chunk_size(r.stream.lookahead, False), False, False
        return n, r.first, r.last

    def _chain_flushes(self, planned: list[_Row]) -> list[_Row]:
        """A flush of two later chunks becomes two rows of one chunk each, the second continuing the
        first (`layers.chain_indices`), so that it rides in the step's regular stack call instead of
        a call of its own; flushes of a stream's first chunk or of more chunks keep their own call."""
        out: list[_Row] = []
        for r in planned:
            later = self._chunk_size(r.stream.lookahead, False) if r.flush and not r.first else 0
            if not later or r.mel.shape[0] != 2 * later:
                out.append(r)
                continue
            chunk = r.stream.lookahead + 1
            lead = _Row(r.index, r.slot, r.stream, r.mel[:later], False, False, chunk, True)
            out += [
                lead,
                _Row(r.index, r.slot, r.stream, r.mel[later:], False, False, chunk, True, chunk, True),
            ]
        return out

    def _plan(self, rows: Sequence[ChunkInput]) -> list[_Row]:
        """Validate every row before anything runs (a refused step changes no stream)."""
        planned = []
        n_mels = self.cfg.n_mels
        streams = self._streams
        for i, row in enumerate(rows):
            stream = streams.get(row.slot)
            if stream is None:
                raise ValueError(f"slot {row.slot} is not allocated")
            if stream.finished:
                raise ValueError(f"slot {row.slot} already received its last chunk")
            mel = row.mel
            if mel.ndim != 2 or mel.shape[1] != n_mels:
                raise ValueError(f"slot {row.slot}: mel of shape {mel.shape}, expected (n, {n_mels})")
            first = stream.chunks == 0
            n = mel.shape[0]
            want = self._chunk_size(stream.lookahead, first)
            which = "first" if first else "later"
            if row.flush:
                later = self._chunk_size(stream.lookahead, False)
                if row.is_last or (n and (n < want or (n - want) % later)):
                    raise ValueError(f"slot {row.slot}: a flush is {want} + k * {later} mel frames, got {n}")
            elif n != want and not (row.is_last and n < want):
                raise ValueError(f"slot {row.slot}: {which} chunk of {n} mel frames, expected {want}")
            last = row.is_last
            T = self._frames_out(n, first, last)
            planned.append(_Row(i, row.slot, stream, mel, first, last, T, row.flush))
        if len({r.slot for r in planned}) != len(planned):
            dup = next(s for s, n in Counter(r.slot for r in planned).items() if n > 1)
            raise ValueError(f"slot {dup} appears twice in one step")
        return planned

    def _chunk_size(self, lookahead: int, first: bool) -> int:
        size = self._sizes.get((lookahead, first))
        if size is None:
            f = self.cfg.subsampling_factor
            size = self._sizes[(lookahead, first)] = (
                first_chunk_frames(lookahead, f) if first else chunk_frames(lookahead, f)
            )
        return size

    def _frames_out(self, n: int, first: bool, last: bool) -> int:
        T = self._frames.get((n, first, last))
        if T is None:
            stages = self.cfg.n_subsampling_stages
            T = self._frames[(n, first, last)] = encoder_frames(n, first, last, stages) if n else 0
        return T

    def _stack_meta(self, group: list[_Row], T: int, padded: int) -> list[np.ndarray]:
        """Per-row numbers of one stack call of T frames per row, from which the device builds the
        call's (rows, Lc) and (rows, T) indices: the gathers' four numbers a row (`_cache_rows`), the
        conv pool's rows, the queries' four numbers a row (`_query_limits`), the prompts (`padded`
        rows, the padding reading only the zero row), then the committing rows' ring and first frame
        (`_ring_writes`) and their conv pool rows.

        A row holds one chunk, a short last chunk padded to T, or (a flush) several chunks: query i
        sits in chunk i // chunk and sees, as chunk by chunk (chunked_limited), the cached frames that
        chunk's left context reaches and the new frames up to its chunk's end or the row's last real
        frame, whichever comes first. So no real query sees a padding frame.

        Only (rows,) arrays are made here: numpy lets go of the interpreter lock in every operation on
        more than a few hundred elements, and a step's thread then waits for the engine's other threads
        (receiver, assemblers, decoder; the event loop in one process) at each, up to the switch
        interval."""
        Lc, B = self._Lc, len(group)
        slot = np.fromiter((r.slot for r in group), np.int64, B)
        a0 = np.fromiter((r.stream.frames + r.ahead for r in group), np.int64, B)  # frames before the row
        chunk = np.fromiter((r.stream.lookahead + 1 for r in group), np.int64, B)
        first = np.fromiter((r.first for r in group), bool, B)
        reach = (Lc // chunk) * chunk  # chunked_limited: Lc // chunk whole chunks to the left
        ring = 1 + slot * Lc
        kv_rows = np.zeros((4, padded), np.int32)  # padding rows: no frame held, the zero row
        kv_rows[2] = Lc
        kv_rows[0, :B] = ring
        kv_rows[1, :B] = a0
        kv_rows[2, :B] = Lc - np.minimum(a0, reach)
        # A flush's second chunk (`ahead`): its newest cache slots are its first chunk's frames, which
        # the pool does not hold yet (the attention takes them from the call, `layers._attention`).
        kv_rows[3, :B] = np.fromiter((r.stream.frames for r in group), np.int64, B)
        conv_idx = np.zeros(padded, np.int32)
        conv_idx[:B] = np.where(first, 0, 1 + slot)
        # Padding rows: no cache frame valid, every new frame seen (one chunk of T frames).
        queries = np.zeros((4, padded), np.int32)
        queries[1:] = T
        queries[0, :B] = a0
        queries[1, :B] = chunk
        queries[2, :B] = reach
        queries[3, :B] = np.fromiter((r.T for r in group), np.int64, B)
        prompt = np.zeros(padded, np.int32)
        prompt[:B] = np.fromiter((r.stream.prompt_id for r in group), np.int32, B)
        commit = np.fromiter((not (r.flush or r.last) for r in group), bool, B)
        return [
            kv_rows,
            conv_idx,
            queries,
            prompt,
            np.stack([ring[commit], a0[commit]]).astype(np.int32),
            (1 + slot[commit]).astype(np.int32),
        ]

    def _bucket(self, B: int) -> int:
        """Rows a compiled call is padded to: every new batch size costs a trace of the whole stack,
        so steps use a few sizes (1, 2, 4, ..., 64, then multiples of 32) instead of every B."""
        if not self.pad_batches:
            return B
        for size in (1, 2, 4, 8, 16, 32, 48, 64):
            if size >= B:
                return size
        return -(-B // 32) * 32

    # mx.compile traces a function again for each new input shape (B, chunk length) and keeps them all.
    def _sub_fn(
        self, first: bool, last: bool, chained: bool, masked: bool, shape: tuple[object, ...]
    ) -> Callable[..., tuple[mx.array, ...]]:
        if not self._compiled_for(shape):
            return partial(_subsample_step, self.params, first, last, chained, masked)
        key = (first, last, chained, masked)
        fn = self._sub_fns.get(key)
        if fn is None:
            fn = mx.compile(partial(_subsample_step, self.params, first, last, chained, masked))
            self._sub_fns[key] = fn
        return fn

    def _stack_fn(
        self, T: int, chained: bool, shape: tuple[object, ...]
    ) -> Callable[..., tuple[mx.array, ...]]:
        if not self._compiled_for(shape):
            return partial(_stack_step, self.params)
        fn = self._stack_fns.get((T, chained))
        if fn is None:
            fn = mx.compile(partial(_stack_step, self.params))
            self._stack_fns[(T, chained)] = fn
        return fn

    def _compiled_for(self, shape: tuple[object, ...]) -> bool:
        """Whether a call of this shape runs compiled: always when compiling, until `warmup` has run;
        after it, only on the shapes it traced."""
        if not self.compiled:
            return False
        if self._tracing is not None:
            self._tracing.add(shape)
        if self._traced is None or shape in self._traced:
            return True
        self.calls["untraced"] += 1
        return False

    @property
    def rows_per_flush(self) -> int:
        """The most rows a flush runs as: a flush of a later chunk and its padding chunk is split into
        two rows of the regular call (`_chain_flushes`). The engine's scheduler counts a flush so, or
        a step of `max_batch` planned rows could need a batch size the warm-up never compiled."""
        lookaheads = self.cfg.supported_lookaheads
        return 1 + max(flush_extra_chunks(la, lookaheads) for la in lookaheads)

    def warmup(self, lookahead: int, max_batch: int, streams: int = 0) -> int:
        """Trace the compiled step for every batch bucket up to `max_batch` (first and later chunks,
        and a first chunk's flush) so that no live step pays for it; returns the number of buckets. A no-op
        when not compiled (but for one stream's chunks when the CPU's fused kernels are in use). From then
        on, calls of shapes it did not trace (a first chunk that is also the last; a lookahead not warmed)
        run uncompiled rather than trace; a later chunk that ends its stream short rides in the
        regular calls. The pools are first sized for `streams`: the compiled calls take them as inputs,
        so a pool grown later traces every call again at its new shape, in live steps
        (docs/benchmarks.md: 176 ms for one call at full size on a CPU). Where one K|V array would pass
        2**31 values for them, it is split into as few groups of layers as keep each below
        (`kv_groups_for`; at most one a layer)."""
        if not self.compiled:
            if self.params.array_exp:
                self._build_fused_kernels(lookahead)
            return 0
        # On a GPU at most what one array a layer holds (the most streams any layout holds).
        most = None if self.max_streams is None else pool_stream_limit(self.cfg, self.cfg.num_hidden_layers)
        want = streams if most is None else min(streams, most)
        self._regroup(max(self._kv_groups, kv_groups_for(self.cfg, want)))
        if want > self._capacity:
            self._grow(want)
        self._tracing = set() if self._traced is None else set(self._traced)
        self._traced = None
        # A single flush is planned alone whatever its rows (the scheduler's `flush_rows`).
        buckets = sorted({self._bucket(b) for b in range(1, max(max_batch, self.rows_per_flush) + 1)})
        n_mels = self.cfg.n_mels
        extra = flush_extra_chunks(lookahead, self.cfg.supported_lookaheads)
        for B in buckets:
            slots = [self.alloc(0, lookahead) for _ in range(B)]
            try:
                for first in (True, False):
                    size = self._chunk_size(lookahead, first)
                    # A flush of later chunks rides in the regular call (`_chain_flushes`): only a
                    # first chunk's flush has calls of its own.
                    if first:
                        flush = np.zeros(
                            (size + extra * self._chunk_size(lookahead, False), n_mels), np.float32
                        )
                        self.step([ChunkInput(s, flush, flush=True) for s in slots])
                    self.step([ChunkInput(s, np.zeros((size, n_mels), np.float32)) for s in slots])
            finally:
                for s in slots:
                    self.release(s)
        self._traced, self._tracing = self._tracing, None
        self._reset_stats()
        return len(buckets)

    def _reset_stats(self) -> None:
        """Warm-up steps are not the live steps the engine's report counts."""
        self.calls.clear()
        self.seconds = dict.fromkeys(self.seconds, 0.0)

    def _build_fused_kernels(self, lookahead: int) -> None:
        """Every kind of chunk a stream can send, so that the CPU JIT builds the fused sigmoid and
        softmax kernels (`expmath`: g++, seconds on a machine that has not cached them) before a call
        waits for them. A kernel depends on which of its operands' dimensions are 1 or contiguous, not
        on their sizes: first, later, flushed (one chunk, and two: the second continues the first in
        the call) and last chunks, full and one mel frame long, of one stream and of two cover every
        batch. Where the JIT cannot build or load them (its cache under the temp directory not
        writable, g++ broken), the encoder goes on with MLX's kernels and says so."""
        first, later = self._chunk_size(lookahead, True), self._chunk_size(lookahead, False)
        extra = range(flush_extra_chunks(lookahead, self.cfg.supported_lookaheads) + 1)
        first_flushes = [(first + k * later, True, False) for k in extra]
        later_chunks = [(later * (1 + k), True, False) for k in extra]
        later_chunks += [(later, False, False), (later, False, True)]
        streams = [  # per stream: (mel frames, flush, last) of its chunks, in order
            [*first_flushes, (first, False, False), *later_chunks],
            [(first, False, False), (1, False, True)],
            [(1, False, True)],
        ]
        try:
            with _jit_build_lock():
                for chunks, batch in itertools.product(streams, (1, 2)):
                    slots = [self.alloc(0, lookahead) for _ in range(batch)]
                    try:
                        for n, flush, last in chunks:
                            mel = np.zeros((n, self.cfg.n_mels), np.float32)
                            self.step([ChunkInput(s, mel, is_last=last, flush=flush) for s in slots])
                    finally:
                        for s in slots:
                            self.release(s)
        except RuntimeError as e:
            logger.warning("MLX's CPU JIT could not build the fused kernels (%s): using MLX's", e)
            self._pending.clear()  # the failed step's cache writes
            self.params = dataclasses.replace(self.params, array_exp=False)
        self._reset_stats()

    # ---------------------------------------------------------------------------------------------
    # offline

    def forward_offline(self, mel: np.ndarray, lookahead: int, prompt_id: int) -> np.ndarray:
        """Whole-utterance encoder output (T, J) with the chunked_limited mask of `lookahead`."""
        mel = np.asarray(mel, dtype=np.float32)
        if mel.ndim != 2 or mel.shape[1] != self.cfg.n_mels:
            raise ValueError(f"mel of shape {mel.shape}, expected (n, {self.cfg.n_mels})")
        out = offline_forward(self.params, mx.array(mel), lookahead, prompt_id)
        mx.eval(out)
        return np.array(out)


@contextlib.contextmanager
def _jit_build_lock() -> Iterator[None]:
    """Held while MLX's CPU JIT builds kernels. Engine processes starting together would each run g++
    on the same missing kernel into the same file of MLX's cache (under the temp directory), one
    possibly loading it half-written: the first builds them, the others wait and load them. Opened
    read-only (flock needs no more), so a lock file another user left works too; without a lock file
    at all the build goes on unlocked."""
    try:
        fd = os.open(Path(tempfile.gettempdir()) / "ttg-mlx-jit.lock", os.O_RDONLY | os.O_CREAT, 0o644)
    except OSError as e:
        logger.warning("no JIT build lock (%s): building without it", e)
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def pool_stream_limit(cfg: EncoderConfig, kv_groups: int = 1) -> int:
    """The most slots for which each of `kv_groups` K|V pool arrays, (layers / kv_groups,
    1 + slots * Lc, 2D) values, stays below 2**31."""
    rows = _MAX_POOL_ELEMENTS // (cfg.num_hidden_layers // kv_groups * 2 * cfg.hidden_size)
    return max(1, (rows - 1) // cfg.left_context_frames)


def kv_groups_for(cfg: EncoderConfig, streams: int) -> int:
    """The fewest K|V pool arrays (a divisor of the layers) that hold `streams` slots below 2**31
    values each; one a layer when even those cannot."""
    L = cfg.num_hidden_layers
    return next((g for g in range(1, L + 1) if L % g == 0 and pool_stream_limit(cfg, g) >= streams), L)


def _subsample_step(
    params: EncoderParams,
    first: bool,
    last: bool,
    chained: bool,
    masked: bool,
    mel: mx.array,
    slots: mx.array,
    *rest: mx.array,
) -> tuple[mx.array, ...]:
    """`rest`: the rows' real mel lengths when `masked`, (parent, follows) when `chained`, then the
    subsampling pools."""
    lengths, rest = (rest[0], rest[1:]) if masked else (None, rest)
    chain = (rest[0], rest[1]) if chained else None
    pools = rest[2:] if chained else rest
    caches = None if first else [mx.take(pool, slots, axis=0) for pool in pools]
    x, rows = subsample(params, mel, caches, first, last, chain, lengths)
    return (x, *rows)


def _stack_step(
    params: EncoderParams,
    x: mx.array,
    kv_pools: tuple[mx.array, ...],
    conv_pool: mx.array,
    kv_rows: mx.array,
    conv_idx: mx.array,
    queries: mx.array,
    prompt: mx.array,
    parent: mx.array | None = None,
    follows: mx.array | None = None,
    conv_ctx: mx.array | None = None,
) -> tuple[mx.array, mx.array, mx.array]:
    kv_idx = _cache_rows(kv_rows, params.cfg.left_context_frames)
    kv_cache = []  # per group (layers, 2, H, B, Lc, dh), oldest first
    for pool in kv_pools:
        L, planes, _, _ = pool.shape
        H, dh = planes // 2, params.cfg.hidden_size // (planes // 2)
        values = _take_values(pool.reshape(L * planes, *pool.shape[2:]), kv_idx, params.dtype)
        kv_cache.append(values.reshape(L, 2, H, *kv_idx.shape, dh))
    conv_cache = _take_values(conv_pool, conv_idx, params.dtype)  # (layers, B, K-1, D)
    chain = None
    if parent is not None and follows is not None and conv_ctx is not None:
        chain = (parent, follows, conv_ctx)
    valid, seen = _query_limits(queries, x.shape[1], params.cfg.left_context_frames)
    return encoder_stack(params, x, kv_cache, conv_cache, valid, prompt, seen, chain)


@dataclass(slots=True)
class _SubCall:
    """One subsampling call of a step: its rows and the handles of its inputs in the step's upload."""

    key: tuple[int, bool, bool]  # (mel rows, first, last)
    group: list[_Row]
    chained: bool = False
    masked: bool = False
    inputs: list[int] = dataclasses.field(default_factory=list)  # mel, slots[, lengths][, parent, follows]
    writes: tuple[int, int | None] | None = None  # the committing rows' slots[, their rows in the call]


@dataclass(slots=True)
class _StackCall:
    """One conformer-stack call of a step: rows of padded length T gathered from subsampling calls."""

    T: int
    group: list[_Row] = dataclasses.field(default_factory=list)
    parts: list[tuple[int, int | None]] = dataclasses.field(default_factory=list)  # (sub call, its rows)
    meta: list[int] = dataclasses.field(default_factory=list)
    links: list[int] = dataclasses.field(default_factory=list)
    chained: bool = False
    keep: int | None = None  # the committing rows, when not all
    commits: bool = False


class _Uploads:
    """A step's inputs made on the host, written into one int32 buffer (float32 as its bits, booleans
    as 0/1) and sent to the device as one array; each input is a view (a slice) of it, bit-cast or
    compared back there.

    Why one: on CUDA, `mx.array(ndarray)` takes a host-visible buffer from MLX's allocator, whose cache
    may return a device buffer of that size that it first moves to unified memory (a managed allocation
    and a synchronous copy); a step made a dozen or more. The encoder keeps one, so its host buffer
    lives from step to step (grown when a step needs more) and a step's mel is copied once into it and
    once to the device."""

    def __init__(self) -> None:
        self._buffer = np.zeros(1 << 12, np.int32)
        self._used = 0
        self._parts: list[tuple[int, int, tuple[int, ...], np.dtype]] = []  # (offset, size, shape, dtype)
        self._views: list[mx.array] = []

    def start(self) -> None:
        """A new step: the handles of the last one are void (its views live on where they were used)."""
        self._used = 0
        self._parts.clear()
        self._views.clear()

    def empty(self, shape: tuple[int, ...]) -> tuple[int, np.ndarray]:
        """A float32 input to fill in place, every element of it (it holds the last step's values until
        then): its handle and a writable view, valid until the next `empty` or `add` (the buffer may
        move when it grows)."""
        n = int(np.prod(shape))
        start = self._room(n, shape, np.dtype(np.float32))
        words = self._buffer[start : start + n]
        return len(self._parts) - 1, words.view(np.float32).reshape(shape)

    def add(self, a: np.ndarray) -> int:
        if a.dtype not in (np.int32, np.float32, np.bool_):
            raise TypeError(f"an upload carries int32, float32 or bool, not {a.dtype}")
        start = self._room(a.size, a.shape, a.dtype)
        words = self._buffer[start : start + a.size]
        hostcopy.put(words.view(np.float32) if a.dtype == np.float32 else words, a.reshape(-1))
        return len(self._parts) - 1

    def send(self) -> None:
        device = mx.array(self._buffer[: self._used])  # a copy: the buffer is free for the next step
        for start, n, shape, dtype in self._parts:
            view = device[start : start + n]
            if dtype == np.float32:
                view = view.view(mx.float32)
            elif dtype == np.bool_:
                view = view != 0
            self._views.append(view.reshape(shape))

    def __getitem__(self, handle: int) -> mx.array:
        return self._views[handle]

    def _room(self, n: int, shape: tuple[int, ...], dtype: np.dtype) -> int:
        start = self._used
        if start + n > self._buffer.size:
            grown = np.empty(max(2 * self._buffer.size, start + n), np.int32)
            grown[:start] = self._buffer[:start]
            self._buffer = grown
        self._used = start + n
        self._parts.append((start, n, shape, dtype))
        return start


def _words(dtype: mx.Dtype, n: int) -> tuple[mx.Dtype, int]:
    """The element type a pool stores rows of n values as, and how many per row: 4-byte words where a
    row's bytes divide into them (MLX's gather and scatter kernels move one element per GPU thread, so
    wider elements move the same bytes in fewer; its GPU scatter takes no 8-byte type), else the values
    themselves."""
    size = dtype.size * n
    return (mx.uint32, size // 4) if size % 4 == 0 else (dtype, n)


def _cache_rows(kv_rows: mx.array, Lc: int) -> mx.array:
    """A stack call's cache gather indices (rows, Lc) from (4, rows): per row its ring's first pool row,
    the frames before it (a0), the first of its Lc slots that its left context reaches, and the frames
    its stream has committed. Slot j holds frame a0 - Lc + j, in ring row (a0 - Lc + j) % Lc, when the
    context reaches it and the pool holds it; other slots read the zero row."""
    ring, a0, lo, committed = (kv_rows[i][:, None] for i in range(4))
    j = mx.arange(Lc, dtype=mx.int32)[None, :]
    frame = a0 - Lc + j
    held = (j >= lo) & (frame < committed)
    return mx.where(held, ring + mx.remainder(frame, Lc), 0)


def _query_limits(queries: mx.array, T: int, Lc: int) -> tuple[mx.array, mx.array]:
    """Per query (rows, T) of a stack call, from (4, rows): per row the frames before it (a0), its
    chunk's frames, the left context's reach in whole chunks, and its real frames. Query t sits in
    chunk t // chunk; it sees the newest `valid` cache slots (those its chunk's left context reaches)
    and the first `seen` new frames (its chunk's end, or the row's last real frame)."""
    a0, chunk, reach, real = (queries[i][:, None] for i in range(4))
    ci = mx.arange(T, dtype=mx.int32)[None, :] // chunk
    start = a0 + ci * chunk
    valid = mx.clip(a0 - mx.maximum(start - reach, 0), 0, Lc)
    seen = mx.minimum((ci + 1) * chunk, real)
    return valid, seen


def _ring_writes(rows: mx.array, T: int, Lc: int) -> mx.array:
    """The pool rows the committing rows' T new frames go to, flat, from (2, rows): each row's ring
    (its first pool row) and the frames before it; frame f of a stream lives in ring row f % Lc."""
    ring, a0 = rows[0][:, None], rows[1][:, None]
    return (ring + mx.remainder(a0 + mx.arange(T, dtype=mx.int32)[None, :], Lc)).reshape(-1)


def _take_values(pool: mx.array, idx: mx.array, dtype: mx.Dtype) -> mx.array:
    """`_take_rows` of a pool of words, handed back as `dtype` values. The take reads pairs of words
    as one 8-byte element where a row holds an even number (a view of the whole pool, no copy: it is
    contiguous)."""
    if pool.dtype == mx.uint32 and pool.shape[-1] % 2 == 0:
        pool = pool.view(mx.uint64)
    return _take_rows(pool, idx).view(dtype)


def _take_rows(pool: mx.array, idx: mx.array) -> mx.array:
    """pool (P, N, ...) gathered at rows idx (any shape) of every plane (a layer, or a layer's K or V
    head) -> (P, *idx.shape, ...).

    One gather over the flattened (P * N) rows: each gathered row is contiguous, which MLX copies
    at memory speed (a take along axis 1 moves strided pieces and was ~2x slower on the CPU)."""
    L, N = pool.shape[0], pool.shape[1]
    rows = idx[None] + (mx.arange(L, dtype=idx.dtype) * N).reshape((L,) + (1,) * idx.ndim)
    return mx.take(pool.reshape(L * N, *pool.shape[2:]), rows, axis=0)


def _group(
    rows: list[_Row], key: Callable[[_Row], tuple[int, bool, bool]]
) -> dict[tuple[int, bool, bool], list[_Row]]:
    groups: dict[tuple[int, bool, bool], list[_Row]] = {}
    for r in rows:
        groups.setdefault(key(r), []).append(r)
    return groups


def _mel_lengths(group: list[_Row], padded: int, n: int) -> np.ndarray:
    """Per row of a subsampling call of `n` mel rows (`padded` rows): how many are real."""
    lengths = np.full(padded, n, np.int32)
    lengths[: len(group)] = [r.mel.shape[0] for r in group]
    return lengths


def _parents(group: list[_Row], padded: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row of a call (`padded` rows): the row it continues (itself if none), and whether it does."""
    follows = np.zeros(padded, bool)
    follows[: len(group)] = [r.follows for r in group]
    parent = np.arange(padded, dtype=np.int32)
    parent[follows] -= 1
    return parent, follows


def _padded_length(r: _Row) -> int:
    """Frames per row of the stack call that runs `r`: its chunk's, or a flush's several chunks'."""
    return max(r.T, r.stream.lookahead + 1)

"""The loaded model as the engine sees it: bundle + encoder slot pool + decoder factory + tokenizer.

`AsrModel.load(dir, precision)` loads everything once. The engine only uses the small protocols below
(`EngineModel` and the parts it hands out), so its tests can run against fakes and the real parts can
change behind these seams.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from asr_core.frontend import FrontEnd, FrontEndFactory, FrontEndSpec
from asr_core.transcript import TextDecoder, Token

logger = logging.getLogger(__name__)

SAMPLE_RATE_HZ = 16_000
GPU_CACHE_LIMIT_BYTES = 16 << 30
# What an engine process sharing a card may hold there beyond its MLX limit (`gpu_memory_limits`): the
# driver counted 0.2-2.2 GiB more than MLX's limit or peak per process on an H100 (docs/benchmarks.md).
GPU_PROCESS_RESERVE_BYTES = 3 << 30


class EncoderBackend(Protocol):
    """The MLX slot pool (owned by the engine's MLX thread)."""

    def alloc(self, prompt_id: int, lookahead: int) -> int: ...

    def release(self, slot: int) -> None: ...

    def step(self, rows: Sequence[tuple[int, np.ndarray, bool, bool]]) -> list[np.ndarray]:
        """One batched step over (slot, mel chunk, is_last, flush) rows -> per row (T_i, J) frames.
        A flush row is encoded like the slot's next chunk without changing the slot's state."""


class StreamDecoder(Protocol):
    """RNN-T greedy decoding, one stream's chunk at a time; one instance per worker thread."""

    def new_state(self) -> Any: ...

    def decode(self, state: Any, frames: np.ndarray, first_frame: int) -> list[Token]:
        """Advance `state` over the chunk's frames; tokens with absolute frame indices."""


class BatchDecoder(Protocol):
    """RNN-T greedy decoding of several streams' chunks in one pass (identical tokens)."""

    def new_state(self) -> Any: ...

    def decode_batch(
        self, states: Sequence[Any], frames: Sequence[np.ndarray], first_frames: Sequence[int]
    ) -> list[list[Token]]: ...


class DeviceDecoderBackend(Protocol):
    """Greedy decoding of a whole encoder step on the accelerator (owned by the engine's device-decoder
    thread, which builds it, decodes with it and lets go of it: `close` if it has one)."""

    def alloc_many(self, n: int) -> list[int]:
        """Slots for n new streams (a step's joins)."""
        ...

    def warmup(self, max_rows: int) -> int:
        """Compile what live decodes of up to `max_rows` chunks will run (before the engine is ready)."""
        ...

    def release(self, slot: int) -> None: ...

    def stats(self) -> dict[str, float]:
        """Running totals: decode calls, label-looping iterations queued, host syncs."""
        ...

    def decode(
        self,
        slots: Sequence[int],
        frames: Sequence[np.ndarray],
        first_frames: Sequence[int],
        *,
        commit_frames: Sequence[int] | None = None,
    ) -> list[list[Token]]:
        """Each slot's chunk decoded and its state committed after its first `commit_frames[i]` frames
        (default: all); the rest of the chunk is decoded on from there but not kept (a flush's padding)."""
        ...


class EngineModel(Protocol):
    """What `AsrEngine` needs from a model."""

    @property
    def lookaheads(self) -> tuple[int, ...]: ...

    @property
    def default_lookahead(self) -> int: ...

    @property
    def text(self) -> TextDecoder: ...

    def create_encoder(self) -> EncoderBackend:
        """A fresh encoder slot pool; called on the engine's MLX thread, which then owns it."""

    def prompt_id(self, language: str) -> int: ...

    def new_frontend(self, lookahead: int) -> FrontEnd: ...

    def new_decoder(self) -> StreamDecoder: ...

    def new_batch_decoder(self) -> BatchDecoder: ...

    def new_device_decoder(self) -> DeviceDecoderBackend:
        """Called on the engine's device-decoder thread, which then owns it."""


def gpu_memory_limits(process_limit: int, share: float) -> tuple[int, int]:
    """(memory limit, cache limit) in bytes for an engine process given `share` of the accelerator.

    MLX lets one process use 95 % of a CUDA card (its default memory limit, `process_limit`) and keeps
    freed buffers for reuse up to that limit; at thousands of streams that is the whole card. The
    cache is bounded (GPU_CACHE_LIMIT_BYTES). Engine processes that share a card each get their share
    of the limit less GPU_PROCESS_RESERVE_BYTES, and a cache of at most a quarter of that: each also
    holds memory MLX does not count (its CUDA context, loaded kernels, buffers freed to CUDA's pool and
    not yet returned), and when the processes together fill the card every step slows several times
    over (docs/benchmarks.md: four engines at a quarter each filled an 80 GB card)."""
    if not 0 < share <= 1:
        raise ValueError(f"device share must be in (0, 1], got {share}")
    memory = process_limit if share == 1 else int(process_limit * share) - GPU_PROCESS_RESERVE_BYTES
    if memory < GPU_PROCESS_RESERVE_BYTES:
        raise ValueError(
            f"a {share:.3g} share of {process_limit / 2**30:.1f} GiB leaves this process less than "
            f"{GPU_PROCESS_RESERVE_BYTES / 2**30:.0f} GiB: too many engine processes for this accelerator"
        )
    return memory, min(GPU_CACHE_LIMIT_BYTES, memory // 4)


def release_mlx_thread() -> None:
    """Wait for the calling thread's MLX work and destroy its streams. Every thread that ran MLX work
    calls this last: MLX keeps streams (with their CUDA handles) per thread, and one destroyed after
    the CUDA runtime unloaded at exit aborts the process ("terminate called without an active
    exception"); MLX's advice is to clear them at the end of each thread and of the process."""
    import gc

    import mlx.core as mx

    # Start-up's heap was frozen (asr_core.heap), and a cycle in it may hold arrays: back to the collector.
    gc.unfreeze()
    gc.collect()  # arrays of this thread that only a reference cycle kept
    mx.synchronize()
    mx.clear_streams()


def embedded_model_dir() -> Path | None:
    """The demo model shipped inside the package (asr_core/demo_model/), if this install has it."""
    d = Path(__file__).resolve().parent / "demo_model"
    return d if (d / "nemotron_onnx_config.json").is_file() else None


@dataclass(frozen=True, slots=True)
class LoadedInfo:
    dir: Path
    precision: str
    device: str


class AsrModel:
    """The real model: bundle + MLX encoder + ORT decoders + tokenizer (see `load`).

    Loaded once per process; the engine's MLX thread uses the encoder, each decoder worker gets its
    own decoder (own ORT sessions) from `new_decoder`/`new_batch_decoder`, streams get front ends.
    """

    def __init__(self, bundle: Any, tokenizer: Any, info: LoadedInfo) -> None:
        self.bundle = bundle
        self.info = info
        cfg = bundle.config
        self._lookaheads = tuple(int(r) for r in cfg.encoder.supported_lookaheads)
        self._default_lookahead = int(cfg.encoder.default_lookahead)
        self._text = _TextAdapter(tokenizer)
        self._frontends = FrontEndFactory(self.frontend_spec())  # one log-mel math for every stream

    @classmethod
    def load(cls, model_dir: str | Path, precision: str = "auto", device_share: float = 1.0) -> AsrModel:
        """Load the bundle in `model_dir` once (any layout `load_bundle` reads): validated files, MLX
        encoder weights, tokenizer.

        `precision`: "f32", "f16", "bf16", or "auto" (f32 on the CPU; on a GPU f16, or the stored
        dtype of an MLX layout). `device_share` (0, 1]: the part of the accelerator's memory this
        process may use, where several engine processes share one (`gpu_memory_limits`).
        """
        import mlx.core as mx

        from asr_core.accelerator import this_process
        from asr_core.bundle import load_bundle
        from asr_core.quant import QuantizedLinear
        from asr_core.tokenizer import Tokenizer

        device = this_process().kind
        if device != "cpu":
            memory, cache = gpu_memory_limits(mx.get_memory_limit(), device_share)
            mx.set_memory_limit(memory)
            mx.set_cache_limit(cache)
            logger.info(
                "accelerator memory for this process: %.1f GiB, of it at most %.1f GiB of cached buffers",
                memory / 2**30, cache / 2**30,
            )  # fmt: skip
        bundle = load_bundle(Path(model_dir), precision)
        if device == "cpu":
            from asr_core._blas import cpu_matmuls

            logger.info("CPU matmuls: %s", cpu_matmuls())
        # Materialize the weights here: MLX streams are thread-local (mlx >= 0.31.2), so nothing the
        # MLX thread reads may still be an unevaluated graph of this thread's stream.
        mx.eval(
            [
                a
                for w in bundle.encoder_weights.values()
                for a in (w.arrays() if isinstance(w, QuantizedLinear) else (w,))
            ]
        )
        tokenizer = Tokenizer.from_bundle(bundle)
        packed = f", {len(bundle.quantized)} quantized modules" if bundle.quantized else ""
        logger.info(
            "model loaded from %s (%s layout, %s on %s%s)",
            model_dir,
            bundle.layout,
            bundle.precision,
            device,
            packed,
        )
        return cls(bundle, tokenizer, LoadedInfo(Path(model_dir), bundle.precision, device))

    # -- EngineModel ---------------------------------------------------------------------------

    @property
    def lookaheads(self) -> tuple[int, ...]:
        return self._lookaheads

    @property
    def default_lookahead(self) -> int:
        return self._default_lookahead

    @property
    def text(self) -> TextDecoder:
        return self._text

    def create_encoder(self, *, compile: bool | None = None) -> EncoderBackend:
        """Build the MLX encoder (slot pool, compiled steps) on the calling thread: the engine calls
        this on its MLX thread, because MLX streams, and so everything built on them, are
        thread-local (a pool built on another thread aborts the process at exit). `compile`: the
        device's default (None: compiled and batch-padded on a GPU), or either way for checks."""
        from asr_core.encoder import StreamingEncoder

        cfg = self.bundle.config
        return _EncoderAdapter(
            StreamingEncoder(self.bundle.encoder_weights, cfg.encoder, self.bundle.precision, compile=compile)
        )

    def prompt_id(self, language: str) -> int:
        return int(self.bundle.config.prompt_id(language or "auto"))

    def new_frontend(self, lookahead: int) -> FrontEnd:
        return self._frontends.new(lookahead)

    def frontend_spec(self, vad: Any = None) -> FrontEndSpec:
        """How other processes build this model's front ends; `vad` (a VadConfig) makes them flush at
        speech ends."""
        import dataclasses

        cfg = self.bundle.config
        return FrontEndSpec(
            features=dataclasses.asdict(cfg.features),
            mel_filters=self.bundle.mel_filters,
            subsampling_factor=cfg.encoder.subsampling_factor,
            lookaheads=self._lookaheads,
            default_lookahead=self._default_lookahead,
            prompts=dict(cfg.prompt_dictionary),
            vad=dataclasses.asdict(vad) if vad is not None else {},
        )

    def _graphs(self) -> Any:
        return self.bundle.rnnt_graphs(threads=1)

    def new_decoder(self) -> StreamDecoder:
        from asr_core.decoder import GreedyDecoder

        cfg = self.bundle.config
        return _StreamDecoderAdapter(
            GreedyDecoder(self._graphs(), cfg.blank_token_id, cfg.max_symbols_per_step)
        )

    def new_batch_decoder(self) -> BatchDecoder:
        from asr_core.decoder import BatchedGreedyDecoder

        cfg = self.bundle.config
        return _BatchDecoderAdapter(
            BatchedGreedyDecoder(self._graphs(), cfg.blank_token_id, cfg.max_symbols_per_step)
        )

    def new_device_decoder(self) -> DeviceDecoderBackend:
        from asr_core.decoder.device import DeviceDecoder

        cfg = self.bundle.config
        return _DeviceDecoderAdapter(
            DeviceDecoder(self._graphs().weights(), cfg.blank_token_id, cfg.max_symbols_per_step)
        )


# -- adapters from the parts' own APIs to the engine's protocols ------------------------------------


class _EncoderAdapter:
    def __init__(self, encoder: Any) -> None:
        from asr_core.encoder import ChunkInput

        self._encoder = encoder
        self._row = ChunkInput

    def alloc(self, prompt_id: int, lookahead: int) -> int:
        return int(self._encoder.alloc(prompt_id, lookahead))

    def release(self, slot: int) -> None:
        self._encoder.release(slot)

    def step(self, rows: Sequence[tuple[int, np.ndarray, bool, bool]]) -> list[np.ndarray]:
        return list(
            self._encoder.step([self._row(slot, mel, last, flush) for slot, mel, last, flush in rows])
        )

    @property
    def rows_per_flush(self) -> int:
        return int(self._encoder.rows_per_flush)

    @property
    def max_streams(self) -> int | None:
        """The most streams the encoder's device pools may hold (None: no limit)."""
        limit = self._encoder.max_streams
        return None if limit is None else int(limit)

    def stats(self) -> dict[str, float]:
        """Running totals since warm-up: steps, compiled-function calls, seconds per phase of a step."""
        enc = self._encoder
        return {**enc.calls, **{f"{k}_s": v for k, v in enc.seconds.items()}}

    def memory(self) -> dict[str, int]:
        """MLX's memory in this process, in bytes: in use, cached for reuse, the most in use since the
        last call (which starts the next period's), and the limit past which MLX frees its cache before
        it allocates (on a GPU a synchronizing free: `gpu_memory_limits`)."""
        import mlx.core as mx

        out = {
            "active": mx.get_active_memory(),
            "cached": mx.get_cache_memory(),
            "peak": mx.get_peak_memory(),
            "limit": mx.get_memory_limit(),
        }
        mx.reset_peak_memory()
        return out

    def warmup(self, lookahead: int, max_batch: int, streams: int = 0) -> int:
        """Trace the compiled step for every batch bucket up to `max_batch`, the pools sized for
        `streams` first (GPU; on a CPU, at most one stream's chunks: `StreamingEncoder.warmup`)."""
        return int(self._encoder.warmup(lookahead, max_batch, streams))

    def close(self) -> None:
        """On the thread that built it, after its last step: drop the pools and end the thread's MLX
        streams (see `release_mlx_thread`)."""
        self._encoder = None
        release_mlx_thread()


class _TextAdapter:
    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer

    def decode(self, ids: Sequence[int]) -> tuple[str, str | None]:
        out = self._tok.decode(list(ids))
        return str(out.text), out.language

    def starts_word(self, token_id: int) -> bool:
        return bool(self._tok.starts_word(token_id))


class _StreamDecoderAdapter:
    """The decoder counts frames it consumed; the engine's chunks may have gaps (dropped chunks), so
    emissions are re-based on the chunk's first frame on the media timeline."""

    def __init__(self, decoder: Any) -> None:
        self._dec = decoder

    def new_state(self) -> Any:
        return self._dec.new_state()

    def decode(self, state: Any, frames: np.ndarray, first_frame: int) -> list[Token]:
        base = state.frames
        return [
            Token(int(e.token), first_frame + int(e.frame) - base, float(e.prob))
            for e in self._dec.decode(state, frames)
        ]


class _BatchDecoderAdapter:
    def __init__(self, decoder: Any) -> None:
        self._dec = decoder

    def new_state(self) -> Any:
        return self._dec.new_state()

    def decode_batch(
        self, states: Sequence[Any], frames: Sequence[np.ndarray], first_frames: Sequence[int]
    ) -> list[list[Token]]:
        bases = [s.frames for s in states]
        out = self._dec.decode(list(states), list(frames))
        return [
            [Token(int(e.token), f0 + int(e.frame) - b, float(e.prob)) for e in ems]
            for ems, f0, b in zip(out, first_frames, bases, strict=True)
        ]


class _DeviceDecoderAdapter:
    def __init__(self, decoder: Any) -> None:
        self._dec = decoder

    def alloc_many(self, n: int) -> list[int]:
        return [int(s) for s in self._dec.alloc_many(n)]

    def warmup(self, max_rows: int) -> int:
        return int(self._dec.warmup(max_rows=max_rows))

    def release(self, slot: int) -> None:
        self._dec.release(slot)

    def stats(self) -> dict[str, float]:
        d = self._dec
        return {"decodes": d.decodes, "iterations": d.iterations, "syncs": d.syncs}

    def decode(
        self,
        slots: Sequence[int],
        frames: Sequence[np.ndarray],
        first_frames: Sequence[int],
        *,
        commit_frames: Sequence[int] | None = None,
    ) -> list[list[Token]]:
        out = self._dec.decode(slots, frames, first_frames, commit_frames=commit_frames)
        return [[Token(int(e.token), int(e.frame), float(e.prob)) for e in ems] for ems in out]

    def close(self) -> None:
        """On the thread that built it, after its last decode: drop the device state and end the
        thread's MLX streams (see `release_mlx_thread`)."""
        self._dec = None
        release_mlx_thread()

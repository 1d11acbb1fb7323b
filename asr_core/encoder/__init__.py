"""MLX cache-aware streaming FastConformer encoder (model_spec.md §3, §5), batched over a slot pool.

`StreamingEncoder(weights, cfg, dtype)`: `alloc(prompt_id, lookahead) -> slot`, `release(slot)`,
`step([ChunkInput(slot, mel, is_last)]) -> [frames (T_i, J)]`, `forward_offline(mel, lookahead,
prompt_id)`. The chunk geometry helpers are what the chunker cuts by.

The encoder itself (and with it MLX) is imported on first use, so that the chunk geometry serves
processes that never touch the accelerator (media workers cutting chunks for the engine).
"""

from typing import TYPE_CHECKING, Any

from asr_core.encoder.geometry import chunk_frames, encoder_frames, first_chunk_frames, offline_frames

if TYPE_CHECKING:
    from asr_core.encoder.streaming import ChunkInput, StreamingEncoder

__all__ = [
    "ChunkInput",
    "StreamingEncoder",
    "chunk_frames",
    "encoder_frames",
    "first_chunk_frames",
    "offline_frames",
]


def __getattr__(name: str) -> Any:
    if name in ("ChunkInput", "StreamingEncoder"):
        from asr_core.encoder import streaming

        return getattr(streaming, name)
    raise AttributeError(f"module 'asr_core.encoder' has no attribute {name!r}")

"""MLX cache-aware streaming FastConformer encoder (model_spec.md §3, §5), batched over a slot pool.

`StreamingEncoder(weights, cfg, dtype)`: `alloc(prompt_id, lookahead) -> slot`, `release(slot)`,
`step([ChunkInput(slot, mel, is_last)]) -> [frames (T_i, J)]`, `forward_offline(mel, lookahead,
prompt_id)`. The chunk geometry helpers are what the chunker cuts by.
"""

from asr_core.encoder.geometry import chunk_frames, encoder_frames, first_chunk_frames, offline_frames
from asr_core.encoder.streaming import ChunkInput, StreamingEncoder

__all__ = [
    "ChunkInput",
    "StreamingEncoder",
    "chunk_frames",
    "encoder_frames",
    "first_chunk_frames",
    "offline_frames",
]

"""A streaming safetensors writer: tensors are written one at a time, so a 2.4 GB f32 encoder never
has to sit in memory as a whole (safetensors' own `save_file` takes the complete dict).

Format (https://github.com/huggingface/safetensors#format): u64 little-endian header size N, N bytes
of JSON {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}} padded with spaces
to a multiple of 8, then the raw little-endian data. Offsets are relative to the data section and
tile it without gaps. Files written here are read back by the `safetensors` library in the tests.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import ml_dtypes
import numpy as np
from numpy.typing import NDArray

DTYPES = {
    "f32": ("F32", np.dtype("<f4")),
    "f16": ("F16", np.dtype("<f2")),
    "bf16": ("BF16", np.dtype(ml_dtypes.bfloat16)),
}


def cast(array: NDArray[np.float32], dtype: str) -> NDArray[np.generic]:
    """Round f32 to the stored dtype (round to nearest even, as torch's .to(dtype) does)."""
    return np.ascontiguousarray(array.astype(DTYPES[dtype][1]))


def write_safetensors(
    path: Path,
    shapes: dict[str, tuple[int, ...]],
    produce: Callable[[], Iterable[tuple[str, NDArray[np.float32]]]],
    dtype: str,
    metadata: dict[str, str] | None = None,
) -> None:
    """Write tensors named in `shapes` (all of them, in that order) as they come out of `produce()`."""
    tag, np_dtype = DTYPES[dtype]
    header: dict[str, object] = {}
    offset = 0
    for name, shape in shapes.items():
        size = int(np.prod(shape)) * np_dtype.itemsize
        header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    written: list[str] = []
    with path.open("wb") as fh:
        fh.write(struct.pack("<Q", len(blob)))
        fh.write(blob)
        for name, array in produce():
            if name not in shapes or tuple(array.shape) != tuple(shapes[name]):
                raise ValueError(f"{path.name}: unexpected tensor {name} {tuple(array.shape)}")
            if len(written) >= len(shapes) or list(shapes)[len(written)] != name:
                raise ValueError(f"{path.name}: tensor {name} out of order")
            fh.write(cast(array, dtype).tobytes())
            written.append(name)
    if len(written) != len(shapes):
        missing = [n for n in shapes if n not in set(written)]
        raise ValueError(f"{path.name}: tensors never produced: {missing[:3]}")

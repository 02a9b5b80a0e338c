"""Safetensors files written one tensor at a time, and Hugging Face's index over shards of
them: what an export (`export.py`) and a Hugging Face folder (`meshtrain/hf.py`) both write.
No model and no checkpoint format is known here."""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Callable

import torch

from meshtrain.checkpoint.folders import CheckpointError
from meshtrain.checkpoint.weight_files import SHARD_INDEX  # noqa: F401 (its old home)
from meshtrain.atomic import atomic_write

MAX_SHARD_BYTES = 2 * 10**9  # Hugging Face's default shard size
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                      torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def write_shards(out: Path, tensors: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 read: Callable[[str], torch.Tensor], *, max_shard_bytes: int = MAX_SHARD_BYTES,
                 log: Callable[[str], None] = lambda msg: None) -> list[Path]:
    """Tensors (their shapes and dtypes, by name, in order) as safetensors files of at most
    `max_shard_bytes` each in `out` — `model.safetensors`, or numbered shards and Hugging
    Face's index — asking `read(name)` for one tensor at a time and streaming it to its file
    (`write_safetensors`): what is held at once is one tensor, whatever the shard's size."""

    groups: list[list[str]] = [[]]
    size = 0
    for name, (shape, dtype) in tensors.items():
        n = math.prod(shape) * dtype.itemsize
        if groups[-1] and size + n > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    files = [out / "model.safetensors"] if len(groups) == 1 else \
        [out / f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map = {}
    for path, names in zip(files, groups):
        atomic_write(path, lambda p: write_safetensors(p, {n: tensors[n] for n in names}, read))
        weight_map.update({n: path.name for n in names})
        log(f"wrote {path} ({len(names)} tensors)")
    if len(files) > 1:
        total = sum(math.prod(shape) * dtype.itemsize for shape, dtype in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        atomic_write(out / SHARD_INDEX, lambda p: p.write_text(json.dumps(index, indent=2)))
    return files


def write_safetensors(path: Path, tensors: dict[str, tuple[tuple[int, ...], torch.dtype]],
                      read: Callable[[str], torch.Tensor]) -> None:
    """One safetensors file, its header first (computed from the shapes), then each tensor's
    bytes as `read(name)` gives it: `safetensors.torch.save_file` would hold every tensor
    and a bytes copy of each at once. The format: an 8-byte little-endian header length, a
    JSON header (dtype, shape, data_offsets per tensor) padded with spaces to 8 bytes, the
    data."""
    header, at = {}, 0
    for name, (shape, dtype) in tensors.items():
        if dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{name} is {dtype}, which safetensors files do not hold")
        n = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, (shape, dtype) in tensors.items():
            t = read(name)
            if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise CheckpointError(f"{name}: read {list(t.shape)} {t.dtype}, expected {list(shape)} {dtype}")
            f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
            del t
        f.flush()
        os.fsync(f.fileno())

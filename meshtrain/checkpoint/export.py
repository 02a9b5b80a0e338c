"""A sharded checkpoint of any layout as the one-process model's weights, without starting
ranks: each tensor assembled at full shape from the boxes every rank wrote (DCP reads them
into it, converted to the dtype asked for as it is read), one tensor at a time, and streamed
into safetensors files of at most `max_shard_bytes` each with Hugging Face's
`model.safetensors.index.json` when there are several: what export holds at once is one
tensor and one saved box of it, whatever the model's size. The run's configuration and
tokenizer go beside them, so `generate` reads the folder as it reads a training run's; or,
with `meshtrain.cli.hf_export.export_hf`, the files of a Hugging Face folder (`meshtrain.hf.write_hf`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import torch

from meshtrain.checkpoint import dcp, folders
from meshtrain.checkpoint.boxes import Box
from meshtrain.checkpoint.dcp import Boxed
from meshtrain.checkpoint.safetensors_files import (MAX_SHARD_BYTES, SAFETENSORS_DTYPES, SHARD_INDEX,
                                                    write_safetensors, write_shards)
from meshtrain.checkpoint.folders import CorruptCheckpoint
from meshtrain.checkpoint.sharded import CheckpointError, read_meta
from meshtrain.checkpoint.weight_files import weight_files
from meshtrain.comm import Comm
from meshtrain.mesh import Mesh
from meshtrain.atomic import atomic_write
from meshtrain.checkpoint.owner import RUN_FILE

# Where they were before `safetensors_files.py`: callers import them from here.
_REEXPORTED = (SHARD_INDEX, write_safetensors)
WEIGHTS_PREFIXES = ("model/", "buffer/")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}  # export --dtype
_SAFETENSORS_TORCH = {v: k for k, v in SAFETENSORS_DTYPES.items()}


def is_sharded_checkpoint(folder: Path) -> bool:
    return (Path(folder) / folders.COMPLETE).is_file() and (Path(folder) / dcp.INDEX).is_file()


def weight_shapes(ckpt: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Every weight and buffer of the checkpoint by its one-process name: (shape, dtype)."""
    md = dcp.read_index(ckpt).state_dict_metadata
    return {fqn.split("/", 1)[1]: (m.size, m.properties.dtype) for fqn, m in md.items()
            if fqn.startswith(WEIGHTS_PREFIXES)}


def consolidated(ckpt: Path, names: list[str] | None = None, dtype: torch.dtype | None = None,
                 md=None) -> dict[str, torch.Tensor]:
    """The full tensors `names` (default: every weight and buffer) of the checkpoint, in
    `dtype` where they are floating point (each saved box is converted as it is copied in;
    default: as saved). `md`: the index's metadata, when the caller read it already."""
    md = md if md is not None else dcp.read_index(ckpt).state_dict_metadata
    fqns = {fqn.split("/", 1)[1]: fqn for fqn in md if fqn.startswith(WEIGHTS_PREFIXES)}
    out, state = {}, {}
    for name in names if names is not None else list(fqns):
        m = md[fqns[name]]
        t = torch.empty(m.size, dtype=_as(m.properties.dtype, dtype))
        out[name] = t
        state[fqns[name]] = Boxed(tuple(m.size), t.dtype, [Box((0,) * t.dim(), tuple(t.shape), t)])
    problem = dcp.load(state, Path(ckpt), distributed=False).problem
    if problem is not None:  # the boxes' checksums, checked as they were read
        raise CorruptCheckpoint(f"--ckpt {ckpt}: {problem}")
    return out


def check_good(ckpt: Path) -> None:
    """One process: the checkpoint's files are all there and intact."""
    if not is_sharded_checkpoint(ckpt):
        raise CheckpointError(f"--ckpt {ckpt}: not a sharded checkpoint (a step-N folder written by --save-every "
                              f"or job.save: it has a {folders.COMPLETE} marker and {dcp.INDEX})")
    problem = folders.check(Path(ckpt), Comm(Mesh.single(torch.device("cpu"))))
    if problem is not None:
        raise CheckpointError(f"--ckpt {ckpt}: {problem}")


def _as(saved: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor saved as `saved` is exported in: `dtype` for floating point ones."""
    return dtype if dtype is not None and saved.is_floating_point else saved


def weights_of(folder: Path) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]],
                                      Callable[[str, torch.dtype | None], torch.Tensor]]:
    """A folder's weights (and buffers) by name — (shape, dtype as saved) — and a reader of
    one of them, `read(name, dtype)`, converted to `dtype` where floating point: a sharded
    checkpoint's (DCP reads the boxes of that tensor only) or a folder of safetensors (one
    file, or the shards its index lists)."""
    folder = Path(folder)
    if is_sharded_checkpoint(folder):
        md = dcp.read_index(folder).state_dict_metadata
        shapes = {n: (tuple(s), d) for n, (s, d) in weight_shapes(folder).items()}
        return shapes, lambda name, dtype=None: consolidated(folder, [name], dtype, md=md)[name]
    from safetensors import safe_open

    where: dict[str, Path] = {}
    shapes = {}
    for path in weight_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                where[key] = path
                shapes[key] = (tuple(sl.get_shape()), _SAFETENSORS_TORCH[sl.get_dtype()])

    def read(name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        with safe_open(str(where[name]), framework="pt") as f:
            t = f.get_tensor(name)
        return t.to(_as(t.dtype, dtype))
    return shapes, read


def export(ckpt: Path, out: Path, *, dtype: torch.dtype | None = None, max_shard_bytes: int = MAX_SHARD_BYTES,
           log: Callable[[str], None] = lambda msg: None,
           before_writing: Callable[[], None] = lambda: None) -> list[Path]:
    """Write the checkpoint's weights as safetensors in `out` (and its run's configuration
    and tokenizer), in `dtype` where floating point (default: as saved, the fp32 masters);
    returns the weight files. Holds one tensor at a time. `before_writing()` runs once the
    checkpoint passed its checks, before the first write (the command line clears --out)."""

    ckpt, out = Path(ckpt), Path(out)
    check_good(ckpt)
    shapes, read = weights_of(ckpt)
    before_writing()
    out.mkdir(parents=True, exist_ok=True)
    files = write_shards(out, {n: (s, _as(d, dtype)) for n, (s, d) in shapes.items()}, lambda n: read(n, dtype),
                         max_shard_bytes=max_shard_bytes, log=log)
    meta = read_meta(ckpt)
    if "config" in meta:  # a command-line run's: what `generate` builds the model from
        run = {"config": meta["config"], "vocab_size": meta["vocab_size"], "step": meta["steps"]}
        if "imported" in meta:  # the --init-from folder's configs, for `export --hf` of this folder
            run["imported"] = meta["imported"]
        atomic_write(out / RUN_FILE, lambda p: p.write_text(json.dumps(run, indent=2)))
    for extra in sorted(set(p.name for p in ckpt.iterdir()) & {"tokenizer.json"}):
        atomic_write(out / extra, lambda p: shutil.copyfile(ckpt / extra, p))
    return files

"""A sharded checkpoint of any layout as the one-process model's weights, without starting
ranks: each tensor assembled at full shape from the boxes every rank wrote (DCP reads them
into it), a group of tensors at a time, and written as safetensors files of at most
`max_shard_bytes` each with Hugging Face's `model.safetensors.index.json` when there are
several. The run's configuration and tokenizer go beside them, so `generate` reads the
folder as it reads a training run's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import torch

from meshtrain.checkpoint import dcp, folders
from meshtrain.checkpoint.boxes import Box
from meshtrain.checkpoint.dcp import Boxed
from meshtrain.checkpoint.sharded import CheckpointError, read_meta

MAX_SHARD_BYTES = 2 * 10**9  # Hugging Face's default shard size
SHARD_INDEX = "model.safetensors.index.json"
WEIGHTS_PREFIXES = ("model/", "buffer/")


def is_sharded_checkpoint(folder: Path) -> bool:
    return (Path(folder) / folders.COMPLETE).is_file() and (Path(folder) / dcp.INDEX).is_file()


def weight_shapes(ckpt: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Every weight and buffer of the checkpoint by its one-process name: (shape, dtype)."""
    md = dcp.read_index(ckpt).state_dict_metadata
    return {fqn.split("/", 1)[1]: (m.size, m.properties.dtype) for fqn, m in md.items()
            if fqn.startswith(WEIGHTS_PREFIXES)}


def consolidated(ckpt: Path, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The full tensors `names` (default: every weight and buffer) of the checkpoint."""
    md = dcp.read_index(ckpt).state_dict_metadata
    fqns = {fqn.split("/", 1)[1]: fqn for fqn in md if fqn.startswith(WEIGHTS_PREFIXES)}
    out, state = {}, {}
    for name in names if names is not None else list(fqns):
        m = md[fqns[name]]
        t = torch.empty(m.size, dtype=m.properties.dtype)
        out[name] = t
        state[fqns[name]] = Boxed(tuple(m.size), t.dtype, [Box((0,) * t.dim(), tuple(t.shape), t)])
    dcp.load(state, Path(ckpt), distributed=False)
    return out


def check_good(ckpt: Path) -> None:
    """One process: the checkpoint's files are all there and intact."""
    from meshtrain.comm import Comm
    from meshtrain.mesh import Mesh
    if not is_sharded_checkpoint(ckpt):
        raise CheckpointError(f"--ckpt {ckpt}: not a sharded checkpoint (a step-N folder written by --save-every "
                              f"or job.save: it has a {folders.COMPLETE} marker and {dcp.INDEX})")
    problem = folders.check(Path(ckpt), Comm(Mesh.single(torch.device("cpu"))))
    if problem is not None:
        raise CheckpointError(f"--ckpt {ckpt}: {problem}")


def write_shards(out: Path, sizes: dict[str, int], load: Callable[[list[str]], dict[str, torch.Tensor]], *,
                 max_shard_bytes: int = MAX_SHARD_BYTES, log: Callable[[str], None] = lambda msg: None) -> list[Path]:
    """Tensors (their byte `sizes`, by name, in order) as safetensors files of at most
    `max_shard_bytes` each in `out` — `model.safetensors`, or numbered shards and Hugging
    Face's index — asking `load(names)` for one shard's tensors at a time."""
    from safetensors.torch import save_file

    from meshtrain.atomic import atomic_write

    groups: list[list[str]] = [[]]
    size = 0
    for name, n in sizes.items():
        if groups[-1] and size + n > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    files = [out / "model.safetensors"] if len(groups) == 1 else \
        [out / f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map = {}
    for path, names in zip(files, groups):
        tensors = load(names)
        atomic_write(path, lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
        weight_map.update({n: path.name for n in names})
        log(f"wrote {path} ({len(names)} tensors)")
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        atomic_write(out / SHARD_INDEX, lambda p: p.write_text(json.dumps(index, indent=2)))
    return files


def export(ckpt: Path, out: Path, *, max_shard_bytes: int = MAX_SHARD_BYTES,
           log: Callable[[str], None] = lambda msg: None) -> list[Path]:
    """Write the checkpoint's weights as safetensors in `out` (and its run's configuration
    and tokenizer); returns the weight files. Holds one shard's tensors at a time."""
    from meshtrain.atomic import atomic_write
    from meshtrain.checkpoint.owner import RUN_FILE

    ckpt, out = Path(ckpt), Path(out)
    check_good(ckpt)
    shapes = weight_shapes(ckpt)
    out.mkdir(parents=True, exist_ok=True)
    files = write_shards(out, {n: s.numel() * d.itemsize for n, (s, d) in shapes.items()},
                         lambda names: consolidated(ckpt, names), max_shard_bytes=max_shard_bytes, log=log)
    meta = read_meta(ckpt)
    if "config" in meta:  # a command-line run's: what `generate` builds the model from
        run = {"config": meta["config"], "vocab_size": meta["vocab_size"], "step": meta["steps"]}
        atomic_write(out / RUN_FILE, lambda p: p.write_text(json.dumps(run, indent=2)))
    for extra in sorted(set(p.name for p in ckpt.iterdir()) & {"tokenizer.json"}):
        atomic_write(out / extra, lambda p: shutil.copyfile(ckpt / extra, p))
    return files

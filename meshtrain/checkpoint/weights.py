"""The trained model on disk: the full (unsharded) weights in safetensors, the run's record
beside them (`run.json`), and the tokenizer, so that a folder is enough to sample from.
Every file is written under a temporary name and renamed, so a checkpoint is never
half-written. (The whole training state, sharded and resumable in any layout, is
`sharded.py`'s; what a command-line run saves and reads back with its configuration is
`meshtrain.cli.run_model`'s.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import torch

from meshtrain.atomic import atomic_write
from meshtrain.checkpoint.owner import RUN_FILE, read_run
from meshtrain.data.tokenizer import TOKENIZER_FILE, ByteTokenizer
from meshtrain.checkpoint.safetensors_files import write_safetensors
from meshtrain.checkpoint.weight_files import SHARD_INDEX

WEIGHTS_FILE = "model.safetensors"


def save_weights(out: Path, tensors: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 read: Callable[[str], torch.Tensor], record: dict, data) -> None:
    """The weights (`tensors`: shape and dtype by name, in order; `read(name)` gives each in
    turn, so one at a time is held: `write_safetensors`) in OUT/model.safetensors, `record`
    (JSON-able) in OUT/run.json beside the run's own record (its id), and `data`'s
    tokenizer: the model's embedding rows as `vocab_size` (an imported tokenizer may have
    fewer tokens) and its tokenizer.json unless it is the byte tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    meta = {**read_run(out), **record}
    tokenizer = getattr(data, "tokenizer", None)
    if tokenizer is not None:  # the model's embedding rows (an imported tokenizer may have fewer tokens)
        meta["vocab_size"] = getattr(data, "vocab_size", None) or tokenizer.vocab_size
        folder = getattr(data, "folder", None)
        if tokenizer.vocab_size != ByteTokenizer.vocab_size and folder is not None:
            atomic_write(out / TOKENIZER_FILE, lambda p: shutil.copyfile(folder / TOKENIZER_FILE, p))
    atomic_write(out / WEIGHTS_FILE, lambda p: write_safetensors(p, tensors, read))
    atomic_write(out / RUN_FILE, lambda p: p.write_text(json.dumps(meta, indent=2)))


def is_hf_export(folder: Path) -> bool:
    """A Hugging Face folder (config.json beside its weights) that is no run's folder."""
    folder = Path(folder)
    return (folder / "config.json").is_file() and not (folder / RUN_FILE).exists() and \
        ((folder / WEIGHTS_FILE).is_file() or (folder / "model.safetensors.index.json").is_file())


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """One safetensors file, or the shards its Hugging Face index lists."""
    from safetensors.torch import load_file

    if (folder / WEIGHTS_FILE).exists():
        return load_file(str(folder / WEIGHTS_FILE))
    files = sorted(set(json.loads((folder / SHARD_INDEX).read_text())["weight_map"].values()))
    return {k: v for f in files for k, v in load_file(str(folder / f)).items()}

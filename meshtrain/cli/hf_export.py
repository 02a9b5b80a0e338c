"""A command-line run's Llama as a complete Hugging Face folder, from whatever it was saved
as (a sharded checkpoint of any layout, a run's --out, a plain export): the run's configs
through `run_model.describe`, the weights one tensor at a time through `export.weights_of`,
the folder's files by `meshtrain.hf.write_hf`."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from meshtrain.checkpoint.export import DTYPES, weights_of
from meshtrain.checkpoint.safetensors_files import MAX_SHARD_BYTES
from meshtrain.cli.run_model import describe
from meshtrain import hf
from meshtrain.recipes import family_of


def export_hf(ckpt: Path, out: Path, *, dtype: torch.dtype | None = None, max_shard_bytes: int = MAX_SHARD_BYTES,
              log: Callable[[str], None] = lambda msg: None) -> list[Path]:
    """A command-line run's Llama — a sharded checkpoint of any layout, a run's --out or a
    plain export — as a complete Hugging Face folder in `out` (`meshtrain.hf.write_hf`), in
    `dtype` (default: the run's compute precision), streamed one tensor at a time from the
    saved weights: no model is built but on the meta device. Refuses (ValueError, one line)
    another architecture, and weights that are not that model's."""

    ckpt, out = Path(ckpt), Path(out)
    saved = describe(ckpt)
    family = family_of(saved.spec)
    if not family.hf_folders:
        raise ValueError(f"--hf writes a Llama-architecture model for transformers; {ckpt} holds "
                         f"{saved.config.model.name}: export it without --hf")
    shapes, read = weights_of(ckpt)
    wanted = {family.our_name(n): shape for n, shape in hf.hf_weights(saved.spec, saved.vocab_size).items()}
    tied = hf.tied_copies(saved.spec, saved.vocab_size)
    for name, shape in wanted.items():
        if name not in shapes:
            raise ValueError(f"--ckpt {ckpt}: no {name}, a weight of the run's model ({saved.config.model.name})")
        if shapes[name][0] != shape:
            raise ValueError(f"--ckpt {ckpt}: {name} is {list(shapes[name][0])}, but the run's model makes it "
                             f"{list(shape)}")
    extra = sorted(set(shapes) - set(wanted) - tied)
    if extra:
        raise ValueError(f"--ckpt {ckpt}: {extra[0]} is not a weight of the run's model ({saved.config.model.name})")
    dtype = dtype or DTYPES.get(saved.config.layout.precision, torch.float32)
    return hf.write_hf(out, saved.spec, saved.vocab_size, lambda name: read(family.our_name(name), dtype), dtype,
                       side=saved.imported, tokenizer=saved.tokenizer, max_shard_bytes=max_shard_bytes, log=log)

"""A command-line run's model (a Llama; an MoE as Mixtral, Qwen3-MoE or OLMoE) as a complete
Hugging Face folder, from whatever it was saved as (a sharded checkpoint of any layout, a
run's --out, a plain export): the run's configs through `run_model.describe`, the weights
one tensor at a time through `export.weights_of`, the folder's files by
`meshtrain.hf.write_hf`."""

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
              log: Callable[[str], None] = lambda msg: None,
              before_writing: Callable[[], None] = lambda: None) -> list[Path]:
    """A command-line run's model — a sharded checkpoint of any layout, a run's --out or a
    plain export — as a complete Hugging Face folder in `out` (`meshtrain.hf.write_hf`), in
    `dtype` (default: the run's compute precision), streamed one tensor at a time from the
    saved weights (a stacked MoE's experts read once, written one key per expert): no model
    is built but on the meta device. Refuses (ValueError, one line) a model no Hugging Face
    architecture holds, saved state the folder cannot keep (a router's nonzero bias), and
    weights that are not that model's. `before_writing()`: as `export.export`'s."""

    ckpt, out = Path(ckpt), Path(out)
    saved = describe(ckpt)
    family = family_of(saved.spec)
    if not family.hf_folders:
        raise ValueError(f"--hf writes a model of an architecture transformers has (Llama, Mixtral, Qwen3-MoE, "
                         f"OLMoE); {ckpt} holds {saved.config.model.name}: export it without --hf")
    spec = saved.spec  # with the run's --moe-* flags (`describe`): its balancing decides what state it saved
    shapes, read = weights_of(ckpt)
    wanted = hf.our_weights(spec, saved.vocab_size)
    tied = hf.tied_copies(spec, saved.vocab_size)
    state = hf.state_buffers(spec, saved.vocab_size)
    for name, shape in wanted.items():
        if name not in shapes:
            raise ValueError(f"--ckpt {ckpt}: no {name}, a weight of the run's model ({saved.config.model.name})")
        if shapes[name][0] != shape:
            raise ValueError(f"--ckpt {ckpt}: {name} is {list(shapes[name][0])}, but the run's model makes it "
                             f"{list(shape)}")
    for name in sorted(set(shapes) - set(wanted) - tied):
        problem = family.hf_state_problem(spec, name, read(name)) if name in state else \
            f"{name} is not a weight of the run's model ({saved.config.model.name})"
        if problem:
            raise ValueError(f"--ckpt {ckpt}: {problem}; export it without --hf")
    dtype = dtype or DTYPES.get(saved.config.layout.precision, torch.float32)
    return hf.write_hf(out, spec, saved.vocab_size, lambda name: read(name, dtype), dtype,
                       side=saved.imported, tokenizer=saved.tokenizer, max_shard_bytes=max_shard_bytes, log=log,
                       before_writing=before_writing)

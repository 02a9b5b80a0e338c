"""The trained model on disk: the full (unsharded) weights in safetensors, the run's
configuration, and the tokenizer, so that a folder is enough to sample from. Every file is
written under a temporary name and renamed, so a checkpoint is never half-written.
(The whole training state, sharded and resumable in any layout, is `sharded.py`'s.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from meshtrain.atomic import atomic_write
from meshtrain.checkpoint.owner import RUN_FILE, read_run
from meshtrain.config import Config, adopt_imported_model
from meshtrain.data.tokenizer import TOKENIZER_FILE, ByteTokenizer, load_tokenizer

WEIGHTS_FILE = "model.safetensors"


def save_model(out: Path, state: dict[str, torch.Tensor], cfg: Config, data) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    meta = {**read_run(out), "config": cfg.to_dict()}  # beside what the run recorded of itself (its id)
    tokenizer = getattr(data, "tokenizer", None)
    if tokenizer is not None:
        meta["vocab_size"] = tokenizer.vocab_size
        folder = getattr(data, "folder", None)
        if tokenizer.vocab_size != ByteTokenizer.vocab_size and folder is not None:
            atomic_write(out / TOKENIZER_FILE, lambda p: shutil.copyfile(folder / TOKENIZER_FILE, p))
    atomic_write(out / WEIGHTS_FILE, lambda p: save_file({k: v.contiguous() for k, v in state.items()}, str(p)))
    atomic_write(out / RUN_FILE, lambda p: p.write_text(json.dumps(meta, indent=2)))


def load_model(ckpt: Path, device="cpu"):
    """(model, tokenizer, config) from a folder written by `save_model` or `export.export`
    (one safetensors file or several with their index), or from a sharded checkpoint of
    any layout (a step-N folder of a command-line run)."""
    from meshtrain.checkpoint import export
    from meshtrain.checkpoint.sharded import read_meta
    from meshtrain.models import build_model

    ckpt = Path(ckpt)
    if export.is_sharded_checkpoint(ckpt):
        export.check_good(ckpt)
        meta = read_meta(ckpt)
        if "config" not in meta:
            raise ValueError(f"--ckpt {ckpt}: a checkpoint written by job.save, without a command-line run's "
                             f"configuration; load it with job.load")
        state = export.consolidated(ckpt)
    else:
        if not (ckpt / RUN_FILE).exists() or not ((ckpt / WEIGHTS_FILE).exists() or (ckpt / export.SHARD_INDEX).exists()):
            raise FileNotFoundError(f"--ckpt {ckpt}: no {WEIGHTS_FILE} and {RUN_FILE} there; "
                                    f"train first (meshtrain train --out {ckpt})")
        meta = json.loads((ckpt / RUN_FILE).read_text())
        state = _read_weights(ckpt)
    cfg = Config.from_dict(meta["config"])
    adopt_imported_model(cfg)  # a run from --init-from: its folder's architecture
    if cfg.model.name == "mlp":
        raise ValueError("--ckpt holds the digits MLP, which does not generate text")
    model = build_model(cfg.model.name, cfg.train.seed, vocab_size=meta["vocab_size"], dropout=cfg.model.dropout,
                        attention=cfg.model.attention)
    model.load_state_dict(state)
    return model.to(device).eval(), load_tokenizer(ckpt, meta["vocab_size"]), cfg


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """One safetensors file, or the shards its Hugging Face index lists."""
    from safetensors.torch import load_file

    from meshtrain.checkpoint.export import SHARD_INDEX
    if (folder / WEIGHTS_FILE).exists():
        return load_file(str(folder / WEIGHTS_FILE))
    files = sorted(set(json.loads((folder / SHARD_INDEX).read_text())["weight_map"].values()))
    return {k: v for f in files for k, v in load_file(str(folder / f)).items()}

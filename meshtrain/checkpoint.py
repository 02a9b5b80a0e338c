"""The trained model on disk: the full (unsharded) weights in safetensors, the run's
configuration, and the tokenizer, so that a folder is enough to sample from. Every file is
written under a temporary name and renamed, so a checkpoint is never half-written.
(Sharded checkpoints with optimizer state, resumable in another layout, come later.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from meshtrain.atomic import atomic_write
from meshtrain.config import Config
from meshtrain.data.tokenizer import TOKENIZER_FILE, ByteTokenizer, load_tokenizer

WEIGHTS_FILE = "model.safetensors"
RUN_FILE = "run.json"


def save_model(out: Path, state: dict[str, torch.Tensor], cfg: Config, data) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    meta = {"config": cfg.to_dict()}
    tokenizer = getattr(data, "tokenizer", None)
    if tokenizer is not None:
        meta["vocab_size"] = tokenizer.vocab_size
        folder = getattr(data, "folder", None)
        if tokenizer.vocab_size != ByteTokenizer.vocab_size and folder is not None:
            atomic_write(out / TOKENIZER_FILE, lambda p: shutil.copyfile(folder / TOKENIZER_FILE, p))
    atomic_write(out / WEIGHTS_FILE, lambda p: save_file({k: v.contiguous() for k, v in state.items()}, str(p)))
    atomic_write(out / RUN_FILE, lambda p: p.write_text(json.dumps(meta, indent=2)))


def load_model(ckpt: Path, device="cpu"):
    """(model, tokenizer, config) from a folder written by `save_model`."""
    from safetensors.torch import load_file

    from meshtrain.models import build_model

    if not (ckpt / RUN_FILE).exists() or not (ckpt / WEIGHTS_FILE).exists():
        raise FileNotFoundError(f"--ckpt {ckpt}: no {WEIGHTS_FILE} and {RUN_FILE} there; "
                                f"train first (meshtrain train --out {ckpt})")
    meta = json.loads((ckpt / RUN_FILE).read_text())
    cfg = Config.from_dict(meta["config"])
    if cfg.model.name == "mlp":
        raise ValueError("--ckpt holds the digits MLP, which does not generate text")
    model = build_model(cfg.model.name, cfg.train.seed, vocab_size=meta["vocab_size"], dropout=cfg.model.dropout,
                        attention=cfg.model.attention)
    model.load_state_dict(load_file(str(ckpt / WEIGHTS_FILE)))
    return model.to(device).eval(), load_tokenizer(ckpt, meta["vocab_size"]), cfg


# ---- a Job's full state (job.save / job.load) --------------------------------------------------
# The interim format, until sharded checkpoints land: the full state in three files that rank
# 0 writes — weights, optimizer state by (parameter name, key), and the rest as JSON (no pickle).
# Loading reads them whole on every rank, which keeps its part.

JOB_WEIGHTS, JOB_OPTIM, JOB_META = "model.safetensors", "optim.safetensors", "job.json"
_KEY_SEP = "::"


def save_job(job, directory) -> None:
    """Collective: `job`'s full state into `directory` (rank 0 writes)."""
    from safetensors.torch import save_file

    state = job.state_dict()
    if not job.mesh.is_main:
        return
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    optim = {f"{name}{_KEY_SEP}{key}": t.contiguous() for name, entry in state["optim"].items()
             for key, t in entry.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in job.optimizer.param_groups]
    meta = {"steps": state["steps"], "param_groups": groups, "lr_scheduler": state.get("lr_scheduler")}
    try:
        text = json.dumps(meta, indent=2)
    except TypeError as e:
        raise TypeError(f"job.save: the optimizer's or scheduler's state is not plain data ({e})") from None
    atomic_write(out / JOB_WEIGHTS, lambda p: save_file({k: v.contiguous() for k, v in state["model"].items()}, str(p)))
    atomic_write(out / JOB_OPTIM, lambda p: save_file(optim, str(p)))
    atomic_write(out / JOB_META, lambda p: p.write_text(text))


def load_job(job, directory) -> None:
    """Every rank reads what `save_job` wrote and keeps its part (any layout)."""
    from safetensors.torch import load_file

    folder = Path(directory)
    missing = [f for f in (JOB_WEIGHTS, JOB_OPTIM, JOB_META) if not (folder / f).exists()]
    if missing:
        raise FileNotFoundError(f"job.load: {folder} has no {', '.join(missing)}; write it with job.save")
    optim: dict[str, dict] = {}
    for flat, t in load_file(str(folder / JOB_OPTIM)).items():
        name, _, key = flat.rpartition(_KEY_SEP)
        optim.setdefault(name, {})[int(key) if key.isdigit() else key] = t
    meta = json.loads((folder / JOB_META).read_text())
    state = {"model": load_file(str(folder / JOB_WEIGHTS)), "optim": optim, "steps": meta["steps"]}
    if meta.get("lr_scheduler") is not None:
        state["lr_scheduler"] = meta["lr_scheduler"]
    job.load_state_dict(state)
    for group, saved in zip(job.optimizer.param_groups, meta["param_groups"]):
        group.update({k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in saved.items()})

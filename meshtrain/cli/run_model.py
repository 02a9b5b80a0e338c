"""A command-line run's model on disk, with its configuration: `save_model` writes the final
weights with the run's `Config` (`checkpoint.weights.save_weights`), and `describe` and
`load_model` read a run's folder, a sharded checkpoint of any layout or an export back —
the model, its spec and vocabulary, and the configs of a folder it was imported from — for
`generate` and `export --hf` (`hf_export.py`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from meshtrain.checkpoint.owner import RUN_FILE
from meshtrain.checkpoint.weights import WEIGHTS_FILE, is_hf_export, save_weights
from meshtrain.cli.config import Config
from meshtrain.data.tokenizer import TOKENIZER_FILE, ByteTokenizer, load_tokenizer
from meshtrain.hf import CONFIG, GENERATION_CONFIG, load_hf, side_files, spec_from_config, special_ids
from meshtrain.recipes import PUBLISHED, family_of, is_preset, is_published, spec_of
from meshtrain.parallel.state import persistent_buffers


def save_model(out: Path, parallel, cfg: Config, data) -> None:
    """Collective: the run's final weights in `out`, streamed to rank 0 one tensor at a time
    as it writes them (`Parallelized.stream_to_main`: no host holds more than one full
    tensor beyond its own shard), its configuration (and what it keeps of an --init-from
    folder, `imported_record`) in run.json beside the run's own record. Whatever happens to
    rank 0's writing, every rank's collectives run to their end before it is raised."""
    entries = parallel.entries_of("model")
    stream = parallel.stream_to_main("model", entries)
    try:
        if parallel.comm.mesh.is_main:
            save_weights(out, {e.name: (e.shape, e.dtype) for stage in entries for e in stage},
                         partial(_next_of, stream), {"config": cfg.to_dict(), **imported_record(cfg)}, data)
    finally:
        for _ in stream:
            pass


def _next_of(stream, name: str) -> torch.Tensor:
    entry, full = next(stream)
    if entry.name != name:
        raise RuntimeError(f"the final weights came as {entry.name} where {name} was expected")
    return full


@dataclass
class Saved:
    """What a folder says of the model it holds: the run's configuration, the vocabulary, the
    model's spec, the configs of the folder it was imported from (`hf.side_files`; {}
    when it was not) and its tokenizer file (None: the byte tokenizer, or none was kept)."""
    config: Config
    vocab_size: int
    spec: Any
    imported: dict
    tokenizer: Path | None


def imported_record(cfg: Config) -> dict:
    """What a checkpoint or a run's --out keeps of the --init-from folder, as JSON-able meta:
    {"imported": its configs (`hf.side_files`)}, or {} for a run that imported none.
    With it, `describe` (export --hf, generate) needs the folder no more."""
    if not cfg.model.init_from:
        return {}
    return {"imported": side_files(cfg.model.init_from)}


def describe(ckpt: Path) -> Saved:
    """What a run's folder holds (a sharded checkpoint of any layout, a run's --out, or a plain
    export): refused in one line (ValueError, FileNotFoundError, CheckpointError) where it is
    none of those, or where the run imported a folder (--init-from) that is gone and the
    checkpoint keeps no copy of its configs (checkpoints written before they did)."""
    from meshtrain.checkpoint import export
    from meshtrain.checkpoint.sharded import read_meta

    ckpt = Path(ckpt)
    if export.is_sharded_checkpoint(ckpt):
        export.check_good(ckpt)
        meta = read_meta(ckpt)
        if "config" not in meta:
            raise ValueError(f"--ckpt {ckpt}: a checkpoint written by job.save, without a command-line run's "
                             f"configuration; load it with job.load")
    else:
        meta = json.loads((ckpt / RUN_FILE).read_text()) if (ckpt / RUN_FILE).is_file() else {}
        if "config" not in meta or not ((ckpt / WEIGHTS_FILE).exists() or (ckpt / export.SHARD_INDEX).exists()):
            hf = " (it is a Hugging Face folder already)" if is_hf_export(ckpt) else ""
            raise FileNotFoundError(f"--ckpt {ckpt}: no {WEIGHTS_FILE} and {RUN_FILE} there{hf}; "
                                    f"train first (meshtrain train --out {ckpt})")
    cfg = Config.from_dict(meta["config"])
    imported, vocab = {}, int(meta["vocab_size"])
    if cfg.model.init_from:
        folder = Path(cfg.model.init_from)
        imported = meta.get("imported") or {}
        if CONFIG not in imported:
            if not (folder / CONFIG).is_file():
                raise ValueError(f"--ckpt {ckpt}: its run fine-tuned {folder} (--init-from), which is gone, and "
                                 f"the checkpoint keeps no copy of its {CONFIG}; put that folder back")
            imported = side_files(folder)
        # its embedding's rows (a run's --out recorded its tokenizer's size before, which may be fewer)
        spec, vocab = spec_from_config(imported[CONFIG], str(folder / CONFIG))
    else:
        spec = _preset(cfg)
    if cfg.model.moe_options():  # a mixture of experts' --moe-* flags: its balancing decides what state it saved
        spec = family_of(spec).with_options(spec, moe=cfg.model.moe_options())
    tokenizer = ckpt / TOKENIZER_FILE if (ckpt / TOKENIZER_FILE).is_file() else None
    return Saved(cfg, vocab, spec, imported, tokenizer)


def _preset(cfg: Config):
    name = cfg.model.name
    if is_published(name) and not is_preset(name):
        return PUBLISHED[name][0]
    if not is_preset(name):
        raise ValueError(f"--ckpt: the run's model {name!r} is no preset meshtrain builds; load its weights "
                         f"({WEIGHTS_FILE}) into your model yourself")
    return spec_of(name, cfg.model.mlp_hidden)


def load_model(ckpt: Path, device="cpu"):
    """(model, tokenizer, config) from a folder written by `save_model` or `export.export`
    (one safetensors file or several with their index), from a sharded checkpoint of any
    layout (a step-N folder of a command-line run), or from a Hugging Face folder (`export
    --hf`'s; its config then says only the context length, `train.seq_len`). The weights are
    read in fp32."""
    from meshtrain.checkpoint import export
    from meshtrain.recipes.build import build_model

    ckpt = Path(ckpt)
    if is_hf_export(ckpt):
        return _load_hf_export(ckpt, device)
    saved = describe(ckpt)
    cfg = saved.config
    if cfg.model.name == "mlp":
        raise ValueError("--ckpt holds the digits MLP, which does not generate text")
    shapes, read = export.weights_of(ckpt)
    family = family_of(saved.spec)
    if family.hf_folders:  # Llama, MoE (maybe --init-from's, no preset): built on meta, filled from the saved state
        with torch.device("meta"):
            model = family.build(saved.spec, vocab_size=saved.vocab_size)
        model.to_empty(device="cpu")
        for b in model.buffers():  # running state (a router's load count); what was saved is read below
            b.zero_()
        if saved.spec.tie_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        names = dict(model.named_parameters()) | dict(persistent_buffers(model))
        missing = sorted(set(names) - set(shapes))
        if missing:
            raise ValueError(f"--ckpt {ckpt}: no {missing[0]}, a weight of the run's model ({cfg.model.name})")
        with torch.no_grad():
            for name, p in names.items():
                p.copy_(read(name, torch.float32))
    else:
        model = build_model(cfg.model.name, cfg.train.seed, vocab_size=saved.vocab_size, dropout=cfg.model.dropout,
                            attention=cfg.model.attention, moe=cfg.model.moe_options())
        model.load_state_dict({n: read(n, torch.float32) for n in shapes})
    return model.to(device).eval(), load_tokenizer(ckpt, saved.vocab_size), cfg


def end_of_text_ids(ckpt: Path) -> frozenset[int]:
    """The ids that end a generated text, read as transformers' `generate` reads them: the
    generation config's `eos_token_id` (an id or a list), else the config's, else the
    tokenizer config's EOS token — of the folder itself (a Hugging Face one) or of the folder
    a run imported (--init-from); for a run of meshtrain's own BPE, `<|endoftext|>`; none for
    the byte tokenizer."""
    from tokenizers import Tokenizer

    ckpt = Path(ckpt)
    if is_hf_export(ckpt):
        side, tokenizer = side_files(ckpt), ckpt / TOKENIZER_FILE
    else:
        saved = describe(ckpt)
        side, tokenizer = saved.imported, saved.tokenizer
    tok = Tokenizer.from_file(str(tokenizer)) if tokenizer is not None and tokenizer.is_file() else None
    eos = side.get(GENERATION_CONFIG, {}).get("eos_token_id")
    if eos is None:
        eos = special_ids(side, tok)["eos"]
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    return frozenset(int(i) for i in ids)


def _load_hf_export(folder: Path, device):
    """A Hugging Face folder's model (a Llama, Mixtral, Qwen3-MoE or OLMoE) in fp32, its
    tokenizer (tokenizer.json; the byte tokenizer for a 256-token vocabulary) and a
    configuration saying its family and context length."""
    model = load_hf(folder)
    if model.vocab_size != ByteTokenizer.vocab_size and not (folder / TOKENIZER_FILE).is_file():
        raise FileNotFoundError(f"--ckpt {folder}: a Hugging Face folder without {TOKENIZER_FILE}; put the "
                                f"model's tokenizer.json there")
    cfg = Config()
    cfg.model.name, cfg.model.init_from, cfg.train.seq_len = model.spec.kind, str(folder), model.spec.max_seq_len
    return model.to(device).eval(), load_tokenizer(folder, model.vocab_size), cfg

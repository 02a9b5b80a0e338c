"""`validate`: a configuration that cannot work is refused with one line naming the flag to
change, before any process starts (the model's checks, the layout's, the data's); and
`warnings`: settings that work but are probably not what was meant. `adopt_imported_model`
and `adopt_prepared_data` first take what --init-from's folder and a prepared --data folder
decide (the model, the vocabulary).

No torch import here: a bad flag must fail in a fraction of a second."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

from meshtrain.cli.config import (ATTENTIONS, BUILTIN_DATA, DEVICES, Config, ConfigError, LayoutConfig, TrainConfig,
                                  fill_dp, flag_of, strict_p2p_requested)
from meshtrain.data.corpus import DataError
from meshtrain.hf import HFError, read_config, spec_from_config, weight_files
from meshtrain.parallel.options import (COMPILE_BACKENDS, CP_MODES, FP8_RECIPES, OPTIMIZERS, GRAD_DTYPES, LINEAR_SYNCS, PRECISIONS, SCHEDULES,
                                       expert_problem, parse_recompute, schedule_or_batch_problem)
from meshtrain.recipe import is_user_model
from meshtrain.recipes import PRESETS, PUBLISHED, add_preset, family_of, is_preset, is_published, parse_widths

RECOMPUTE = ("none", "full", "selective", "segments[:K]")


def adopt_imported_model(cfg: Config) -> None:
    """With --init-from DIR the model is that folder's: its spec is registered as a preset
    named after the folder (`hf-<folder>`, a folder already called hf-… keeping its name),
    in every process that reads the configuration, and the vocabulary is its embedding's.
    One line for a folder meshtrain cannot read, and for a --vocab-size the user gave
    (flag or TOML) that is not the folder's: it would be ignored."""
    m = cfg.model
    if not m.init_from:
        return
    folder = Path(m.init_from)
    try:
        spec, vocab = spec_from_config(read_config(folder), str(folder / "config.json"))
        weight_files(folder)
    except HFError as e:
        raise ConfigError(f"--init-from {e}") from None
    if not (folder / "tokenizer.json").is_file():
        raise ConfigError(f"--init-from {folder}: no tokenizer.json; meshtrain trains on text tokenized by the "
                          f"imported model's own tokenizer")
    stated = cfg.train.vocab_size
    if stated != vocab and (("train", "vocab_size") in cfg.given or stated != TrainConfig.vocab_size):
        raise ConfigError(f"--vocab-size {stated} with --init-from {folder}: the vocabulary is the folder's "
                          f"({vocab:,} tokens, its tokenizer's); drop --vocab-size")
    base = re.sub(r"[^A-Za-z0-9._-]", "_", folder.resolve().name)
    name = "hf-" + re.sub(r"^hf[-_]", "", base, flags=re.IGNORECASE)
    if ("model", "name") in cfg.given and m.name != name:  # flag or TOML: it would be ignored
        raise ConfigError(f"--model {m.name} with --init-from {folder}: the model is the folder's ({name}); "
                          f"drop --model")
    add_preset(name, spec)
    m.name, cfg.train.vocab_size = name, vocab


def adopt_prepared_data(cfg: Config) -> None:
    """--data DIR, a token folder `meshtrain prepare` wrote (recognised by its meta.json; a
    folder of text stays text): the vocabulary is that folder's, unless --init-from's model
    sets it (whose tokenizer the folder must have been prepared with: checked with the data).
    One line for a folder of another format version, and for a --vocab-size the user gave
    that is not the folder's."""
    from meshtrain.data.prepared import find, read_meta
    tr = cfg.train
    try:
        folder = find(tr.data) if tr.data not in BUILTIN_DATA else None
        meta = read_meta(folder) if folder is not None else None
    except DataError as e:
        raise ConfigError(str(e)) from None
    if meta is None or cfg.model.init_from:
        return
    if tr.vocab_size != meta["vocab_size"] and ("train", "vocab_size") in getattr(cfg, "given", ()):
        raise ConfigError(f"--vocab-size {tr.vocab_size} with --data {tr.data}: the folder holds ids of its own "
                          f"{meta['vocab_size']:,}-token vocabulary; drop --vocab-size")
    tr.vocab_size = meta["vocab_size"]


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Reject a configuration that cannot work, with one line naming the flag to change.
    `world_size` is the number of processes a launcher already started, if any. An unset
    --dp is filled in here (`fill_dp`)."""
    adopt_imported_model(cfg)
    adopt_prepared_data(cfg)
    m, lay, tr = cfg.model, cfg.layout, cfg.train
    for section, name in [("layout", "dp"), ("layout", "tp"), ("layout", "pp"), ("layout", "cp"), ("layout", "ep"),
                          ("layout", "chunks"),
                          ("layout", "microbatches"), ("train", "steps"), ("train", "batch_size"),
                          ("train", "seq_len"), ("train", "save_every"), ("train", "keep"), ("train", "eval_every"),
                          ("train", "eval_batches")]:
        value = getattr(getattr(cfg, section), name)
        if value is not None and value < 1:  # only dp and the checkpoint flags may be unset (None) here
            raise ConfigError(f"{flag_of(section, name)} {value}: must be a positive integer")
    fill_dp(lay, world_size)
    strict_p2p_requested()
    if tr.seed < 0:
        raise ConfigError(f"--seed {tr.seed}: must not be negative")
    if tr.device not in DEVICES:
        raise ConfigError(f"unknown device '{tr.device}'; use --device {' | '.join(DEVICES)}")
    if not tr.lr > 0:
        raise ConfigError(f"--lr {tr.lr}: must be positive")
    if not lay.bucket_mb > 0:
        raise ConfigError(f"--bucket-mb {lay.bucket_mb}: must be positive")
    if not tr.timeout > 0:
        raise ConfigError(f"--timeout {tr.timeout}: must be a positive number of seconds")
    if tr.max_restarts < 0:
        raise ConfigError(f"--max-restarts {tr.max_restarts}: must not be negative")
    if tr.async_save and not tr.save_every:
        raise ConfigError("--async-save without --save-every: there is no checkpoint to write; add --save-every N")
    if tr.async_pageable and not tr.async_save:
        raise ConfigError("--async-save-pageable without --async-save: it says where --async-save copies the state; "
                          "add --async-save")
    if tr.async_save and tr.keep == 1:
        raise ConfigError("--async-save with --keep 1: the previous checkpoint is what a run falls back on while the "
                          "next is written in the background (or should it prove damaged); use --keep 2 or more")
    if tr.warmup < 0 or tr.clip < 0:
        raise ConfigError(f"--warmup and --clip must not be negative (got {tr.warmup}, {tr.clip})")
    user_model = is_user_model(m.name)
    if user_model and m.dropout:
        raise ConfigError(f"--dropout applies to the preset models; {m.name} has its own nn.Dropout: drop the flag")
    if not user_model and not is_preset(m.name):
        if is_published(m.name):
            how = ("train that architecture from a Hugging Face folder of it: --init-from DIR"
                   if family_of(PUBLISHED[m.name][0]).hf_folders else "meshtrain builds no GPT-3 of the paper's kind")
            raise ConfigError(f"--model {m.name} is a published shape for `meshtrain plan`, not a model train "
                              f"builds; {how}")
        raise ConfigError(f"unknown model '{m.name}'; use --model {' | '.join(PRESETS)}, or pkg.module:factory "
                          f"for your own")
    if not 0 <= m.dropout < 1:
        raise ConfigError(f"--dropout {m.dropout}: use a probability in [0, 1)")
    if m.attention not in ATTENTIONS:
        raise ConfigError(f"unknown attention '{m.attention}'; use --attention {' | '.join(ATTENTIONS)}")
    family = None if user_model else family_of(PRESETS[m.name])
    if m.mlp_hidden:
        if user_model or "hidden" not in family.options:
            raise ConfigError(f"--mlp-hidden sets the widths of --model mlp, not {m.name}; drop it")
        try:
            parse_widths(m.mlp_hidden)
        except ValueError:
            raise ConfigError(f"--mlp-hidden {m.mlp_hidden}: give positive comma-separated widths, "
                              f"e.g. 1024,1024") from None
    if m.moe_options():
        if user_model or "moe" not in family.options:
            flags = ", ".join(f"--moe-{k.replace('_', '-')}" for k in m.moe_options())
            raise ConfigError(f"{flags} applies to the mixture-of-experts presets, not {m.name}; drop it")
    if not user_model and "moe" in family.options:
        problem = family.problems(m.spec())
        if problem:
            raise ConfigError(f"{m.name}: {problem[0]}")
    if m.dropout and not user_model and "dropout" not in family.options:
        raise ConfigError(f"--dropout applies to the GPT models, not {m.name}; drop it")
    if m.attention != "sdpa" and not user_model and "attention" not in family.options \
            and family.attention_heads(PRESETS[m.name]):
        raise ConfigError(f"--attention {m.attention}: {m.name} computes attention with sdpa only; drop the flag")
    if lay.schedule not in SCHEDULES:
        raise ConfigError(f"unknown schedule '{lay.schedule}'; use --schedule {' | '.join(SCHEDULES)}")
    try:
        mode, _ = parse_recompute(lay.recompute)
    except ValueError:
        raise ConfigError(f"unknown recompute policy '{lay.recompute}'; use --recompute {' | '.join(RECOMPUTE)} "
                          f"(K a positive integer)") from None
    if mode == "selective" and not user_model and not family.attention_heads(PRESETS[m.name]):
        raise ConfigError(f"--recompute selective recomputes the attention core; {m.name} has no attention: use "
                          f"--recompute full or segments")
    if lay.precision not in PRECISIONS:
        raise ConfigError(f"unknown precision '{lay.precision}'; use --precision {' | '.join(PRECISIONS)}")
    if lay.zero not in (0, 1, 2, 3):
        raise ConfigError(f"--zero {lay.zero}: use --zero 0, 1, 2 or 3")
    if lay.grad_dtype not in GRAD_DTYPES:
        raise ConfigError(f"unknown gradient dtype '{lay.grad_dtype}'; use --grad-dtype {' | '.join(GRAD_DTYPES)}")
    if lay.compile_backend not in COMPILE_BACKENDS:
        raise ConfigError(f"unknown --compile-backend '{lay.compile_backend}'; use --compile-backend "
                          f"{' | '.join(COMPILE_BACKENDS)}")
    if not lay.compile and (("layout", "compile_backend") in cfg.given
                            or lay.compile_backend != LayoutConfig.compile_backend):
        raise ConfigError(f"--compile-backend {lay.compile_backend} chooses how --compile compiles; add --compile, "
                          f"or drop --compile-backend")
    if lay.dp_linear_sync not in LINEAR_SYNCS:
        raise ConfigError(f"unknown linear-layer sync '{lay.dp_linear_sync}'; use --dp-linear-sync "
                          f"{' | '.join(LINEAR_SYNCS)}")
    if lay.dp_linear_sync == "allgather" and (lay.zero or lay.tp > 1 or lay.pp > 1):
        raise ConfigError("--dp-linear-sync allgather is built for plain data parallelism (with micro-batches), "
                          "not yet with --zero, --tp or --pp; use --dp-linear-sync allreduce")
    _validate_fp8(cfg)
    _validate_optimizer(cfg)
    if lay.keep_gathered and lay.zero != 3:
        raise ConfigError("--keep-gathered applies to --zero 3 (the only stage that frees parameters); drop it")
    if world_size is not None and world_size != lay.world_size:
        raise ConfigError(f"the launcher started {world_size} processes but dp×cp×tp×pp = {lay.dp}×{lay.cp}×{lay.tp}"
                          f"×{lay.pp} = {lay.world_size}; change --dp/--cp/--tp/--pp so that their product is "
                          f"{world_size}")
    if lay.cp > 1:
        _validate_context(cfg, user_model)
    if lay.ep_max_load is not None and (lay.ep == 1 or not lay.ep_max_load >= 1):
        raise ConfigError(f"--ep-max-load {lay.ep_max_load:g}: " + (
            "it bounds the rows expert parallelism moves, and with --ep 1 none move; drop it" if lay.ep == 1 else
            "some rank always receives at least the balanced share; give 1 or more"))
    if lay.ep > 1:  # a user's model: its experts are counted where it is built (meshtrain.parallelize)
        experts = None if user_model else getattr(m.spec(), "n_experts", 0)
        problem = expert_problem(lay, experts, m.name, tr.batch_size, tr.seq_len)
        if problem:
            raise ConfigError(problem)
    problem = schedule_or_batch_problem(lay, tr.batch_size)
    if problem:
        raise ConfigError(problem)
    if user_model:  # its own checks run where it is built (meshtrain.parallelize: one line each)
        if tr.data not in BUILTIN_DATA and not os.path.exists(tr.data):
            raise ConfigError(f"--data {tr.data}: no such file or folder; use --data shakespeare, digits or a text path")
        _reject_unbuilt(lay, tr)
        return
    _validate_data(cfg)
    spec = m.spec()
    _validate_tensor_parallel(cfg, spec)
    _validate_pipeline(cfg, spec)
    problem = family.layout_problem(spec, tp=lay.tp, sp=lay.sp, cp=lay.cp, pp=lay.pp, dp=lay.dp, zero=lay.zero,
                                    micro_rows=tr.batch_size // (lay.dp * lay.microbatches),
                                    microbatches=lay.microbatches)
    if problem:
        raise ConfigError(f"{m.name} {problem}")
    if family.inputs == "tokens":
        positions = family.max_positions(spec)  # a learned table (GPT); RoPE (Llama) has none
        if positions is not None and tr.seq_len > positions:
            raise ConfigError(f"--seq-len {tr.seq_len} exceeds the {positions} positions of {m.name}")
        if m.init_from and tr.seq_len > spec.max_seq_len:  # the length it was made for, its rope scaling included
            scaled = f", its {spec.rope_scaling.kind} rope scaling included" if spec.rope_scaling else ""
            raise ConfigError(f"--seq-len {tr.seq_len} exceeds the {spec.max_seq_len} positions of --init-from "
                              f"{m.init_from} (its max_position_embeddings{scaled}); use --seq-len "
                              f"{spec.max_seq_len} or less")
        if not 256 <= tr.vocab_size <= 2**20:  # above 65,536 the token file holds uint32 ids
            raise ConfigError(f"--vocab-size {tr.vocab_size}: use 256 (bytes) up to {2**20:,}")
    _reject_unbuilt(lay, tr)


def warnings(cfg: Config, command: str = "train") -> list[str]:
    """Settings that work but are probably not what was meant: one line each, the run goes on.
    (A short verify or bench run inside the warm-up is normal: that one is for `train` only.)"""
    tr = cfg.train
    found = []
    if tr.warmup >= tr.steps and command == "train":
        found.append(f"--warmup {tr.warmup} >= --steps {tr.steps}: the learning rate never reaches --lr {tr.lr:g}")
    if tr.max_restarts and not tr.save_every and command == "train" and not cfg.ft.replicas:  # ft: a restart heals
        found.append(f"--max-restarts {tr.max_restarts} without --save-every: a restart starts over from step 0")
    lay = cfg.layout
    if lay.compile and lay.recompute == "full":
        found.append("--compile with --recompute full checkpoints each block whole (no MLP row chunks, whose "
                     "skipped recomputation a compiled graph cannot do): one block's whole MLP more at the backward's "
                     "peak" + ("; the plan counts the chunks" if command == "plan" else ""))
    if lay.compile and command == "plan":
        found.append("--compile: the plan models eager blocks (inductor may keep fewer tensors for backward)")
    if lay.pp > 1 and lay.microbatches < lay.pp:
        found.append(f"--microbatches {lay.microbatches} < --pp {lay.pp}: most stages idle through most of the step "
                     f"(the bubble); use --microbatches {lay.pp} or more")
    if lay.zero and lay.dp * lay.cp == 1:  # cp ranks are parameter replicas too: ZeRO shards over dp × cp
        found.append(f"--zero {lay.zero} with dp=1: there is no data-parallel group to shard over; it runs as --zero 0")
    if lay.dp_linear_sync == "allgather" and lay.dp == 1:
        found.append("--dp-linear-sync allgather with dp=1: there are no other ranks' rows to gather; "
                     "nothing is sent either way")
    if lay.dp_linear_sync == "auto" and (lay.zero or lay.tp > 1 or lay.pp > 1):
        found.append("--dp-linear-sync auto: the all-gather path is built for plain data parallelism only; "
                     "with --zero, --tp or --pp every linear layer all-reduces")
    return found


def _validate_context(cfg: Config, user_model: bool) -> None:
    """Context parallelism, one line each: what it cannot split, and what is not built yet."""
    m, lay, tr = cfg.model, cfg.layout, cfg.train
    if lay.cp_mode not in CP_MODES:
        raise ConfigError(f"unknown --cp-mode '{lay.cp_mode}'; use --cp-mode {' | '.join(CP_MODES)}")
    heads = [] if user_model else family_of(PRESETS[m.name]).attention_heads(PRESETS[m.name])
    if not heads:
        raise ConfigError(f"--cp {lay.cp}: context parallelism splits sequences for attention; {m.name} has none "
                          f"(meshtrain's GPT and Llama presets do): drop --cp")
    if lay.cp_mode == "ulysses":  # whole heads per rank, of those tp leaves it
        for what, n in heads:
            if (n // lay.tp) % lay.cp:
                per_rank = f" ({n // lay.tp} per tp rank)" if lay.tp > 1 else ""
                raise ConfigError(f"--cp-mode ulysses: the {n} {what} of {m.name}{per_rank} do not split over --cp "
                                  f"{lay.cp}; use --cp-mode ring or a --cp dividing them")
    if tr.seq_len % (2 * lay.cp):
        raise ConfigError(f"--seq-len {tr.seq_len} does not split into 2·cp = {2 * lay.cp} equal chunks (head-tail "
                          f"balancing); use a multiple of {2 * lay.cp}")
    if m.dropout and m.attention == "math":
        raise ConfigError(f"--dropout {m.dropout} with --cp and --attention math: attention-probability dropout "
                          f"cannot be split over cp (a rank's blocks see parts of each row); use --attention sdpa "
                          f"(which drops the embedding, attention and MLP outputs only)")
    if lay.sp and (tr.seq_len // lay.cp) % lay.tp:
        raise ConfigError(f"--sp with --cp {lay.cp}: a rank's {tr.seq_len // lay.cp} tokens do not split over --tp "
                          f"{lay.tp}; use a --seq-len divisible by {2 * lay.cp * lay.tp}")


def _validate_data(cfg: Config) -> None:
    data, images = cfg.train.data, family_of(cfg.model.spec()).inputs == "features"
    if images and data != "digits":
        raise ConfigError(f"--model {cfg.model.name} trains on images, not '{data}'; use --data digits")
    if data == "digits" and not images:
        raise ConfigError("--data digits is for --model mlp; use --model mlp or text data")
    if cfg.train.pad_documents and data == "digits":
        raise ConfigError("--pad-documents cuts text documents into rows; --data digits has none: drop the flag")
    if data not in BUILTIN_DATA and not os.path.exists(data):
        raise ConfigError(f"--data {data}: no such file or folder; use --data shakespeare or a text path")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _validate_tensor_parallel(cfg: Config, spec) -> None:
    """Every dimension tensor parallelism splits must divide by tp; SP also splits the sequence."""
    lay, tr, name, family = cfg.layout, cfg.train, cfg.model.name, family_of(spec)
    if lay.tp > 1 and family.tp_plan(spec) is None:
        raise ConfigError(f"--tp {lay.tp}: {name} has no tensor-parallel plan; use --tp 1")
    for size, what in family.tp_splits(spec, tr.vocab_size):
        if size % lay.tp:
            raise ConfigError(f"--tp {lay.tp} does not divide the {size} {what} of {name}; use --tp {_divisors(size)}")
    if lay.sp:
        if lay.tp == 1:
            raise ConfigError("--sp shards the sequence inside the tensor-parallel group; use --tp 2 or more with --sp")
        if family.inputs != "tokens":
            raise ConfigError(f"--sp needs a model with a sequence; {name} has none: drop --sp")
        if tr.seq_len % lay.tp:
            raise ConfigError(f"--sp splits the sequence over tp: --seq-len {tr.seq_len} is not divisible by "
                              f"--tp {lay.tp}; use a multiple of {lay.tp}")


def _validate_pipeline(cfg: Config, spec) -> None:
    """Blocks are split over pp·chunks virtual stages as evenly as possible; each needs one."""
    lay, name, family = cfg.layout, cfg.model.name, family_of(spec)
    if lay.pp > 1 and family.pipeline_plan(spec) is None:
        raise ConfigError(f"--pp {lay.pp}: {name} has no pipeline plan; use --pp 1")
    blocks = family.blocks(spec)
    problem = family.pipeline_problem(spec) if lay.pp > 1 else None
    if problem:
        raise ConfigError(f"{name} {problem}")
    if blocks < lay.pp * lay.chunks:
        raise ConfigError(f"{name} has {blocks} blocks, fewer than pp×chunks = {lay.pp}×{lay.chunks}; "
                          f"use fewer stages or chunks")
    if lay.stage_layers:
        try:
            counts = lay.stage_layer_counts()
        except ValueError:
            raise ConfigError(f"--stage-layers {lay.stage_layers}: give comma-separated block counts, e.g. 3,3,2") from None
        if len(counts) != lay.pp * lay.chunks or sum(counts) != blocks or min(counts) < 1:
            raise ConfigError(f"--stage-layers {lay.stage_layers}: give pp×chunks = {lay.pp * lay.chunks} positive "
                              f"counts that sum to the {blocks} blocks of {name}")


def _validate_optimizer(cfg: Config) -> None:
    """--optimizer: a known one; torchao installed for a low-bit one."""
    name = cfg.train.optimizer
    if name not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer '{name}'; use --optimizer {' | '.join(OPTIMIZERS)}")
    if name != "adamw" and importlib.util.find_spec("torchao") is None:
        raise ConfigError(f"--optimizer {name} is torchao's, which is not installed: pip install 'meshtrain[fp8]' "
                          f"(or use --optimizer adamw)")


def _validate_fp8(cfg: Config) -> None:
    """--fp8 and its two options: a recipe, torchao installed, a schedule and a linear-layer
    sync that leave the linear layers' matmuls to it. (The device and the layers it converts
    are checked where the model is built: `parallel/fp8.py`.)"""
    lay = cfg.layout
    if lay.fp8 == "none":
        for field, flag in (("fp8_emulate", "--fp8-emulate"), ("fp8_min_features", "--fp8-min-features")):
            if getattr(lay, field) != getattr(LayoutConfig, field):
                raise ConfigError(f"{flag} applies to --fp8; add --fp8 tensorwise or rowwise, or drop {flag}")
        return
    if lay.fp8 not in FP8_RECIPES:
        raise ConfigError(f"unknown fp8 recipe '{lay.fp8}'; use --fp8 {' | '.join(('none',) + FP8_RECIPES)}")
    if lay.fp8_min_features < 1:
        raise ConfigError(f"--fp8-min-features {lay.fp8_min_features}: must be a positive integer")
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("--fp8 needs torchao, which is not installed: pip install 'meshtrain[fp8]' (or train "
                          "without --fp8)")
    if lay.schedule == "zb":
        raise ConfigError("--fp8 with --schedule zb: the zero-bubble split backward forms the linear layers' weight "
                          "gradients itself, in high precision; use --schedule 1f1b, gpipe or interleaved")
    if lay.dp_linear_sync != "allreduce":
        raise ConfigError(f"--fp8 with --dp-linear-sync {lay.dp_linear_sync}: the all-gather path forms the linear "
                          "layers' weight gradients itself, in high precision; use --dp-linear-sync allreduce")


def _reject_unbuilt(lay: LayoutConfig, tr: TrainConfig) -> None:
    """Strategies that later issues add. Refuse them plainly rather than run something else."""
    if tr.resume and tr.resume_from:
        raise ConfigError("--resume and --resume-from both say where to resume from; give one")
    if tr.overwrite and (tr.resume or tr.resume_from):
        flag = "--resume" if tr.resume else "--resume-from"
        raise ConfigError(f"--overwrite starts a fresh run (moving another run's checkpoints aside) and {flag} "
                          f"continues one; give one (to resume beside another run's checkpoints, choose another --out)")
    unbuilt: list[tuple[bool, str, str, str]] = []
    for bad, flag, what, fix in unbuilt:
        if bad:
            raise ConfigError(f"{flag}: {what} is not in this version of meshtrain yet; use {fix}")

"""Configuration: dataclasses for the model, the parallel layout and training; a TOML file
sets any field, command-line flags override it, and `validate` rejects a bad layout with
one line naming the flag to change — before any process starts.

No torch import here: a bad flag must fail in a fraction of a second."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from typing import ClassVar
from pathlib import Path

from meshtrain.recipes import PRESETS, PUBLISHED, add_preset, family_of, is_preset, is_published, parse_widths, spec_of
from meshtrain.recipe import is_user_model
from meshtrain.parallel.options import (COMPILE_BACKENDS, CP_MODES, GRAD_DTYPES, LINEAR_SYNCS, PRECISIONS, SCHEDULES,
                                       Layout, expert_problem, parse_recompute, schedule_or_batch_problem)
from meshtrain.hf import HFError, read_config, spec_from_config, weight_files
from meshtrain.data.corpus import DataError

RECOMPUTE = ("none", "full", "selective", "segments[:K]")
ATTENTIONS = ("sdpa", "math")
DEVICES = ("auto", "cpu", "cuda")
BUILTIN_DATA = ("shakespeare", "digits")


class ConfigError(ValueError):
    """A configuration that cannot work; the message is one line that names the fix."""


@dataclass
class ModelConfig:
    name: str = "gpt-small"
    dropout: float = 0.0  # on the embedding, attention output, MLP output (and attention probabilities on `math`)
    attention: str = "sdpa"
    mlp_hidden: str = ""  # the MLP's hidden widths, e.g. "1024,1024"; empty: the preset's
    init_from: str | None = None  # a Hugging Face folder (Llama, Mixtral, Qwen3-MoE, OLMoE): its architecture, weights, tokenizer
    # A mixture-of-experts preset's routing and balancing (None: the preset's own).
    moe_balance: str | None = None  # sequence | batch | bias | none
    moe_aux_coef: float | None = None
    moe_balance_rows: int | None = None  # the batch loss's group of rows
    moe_bias_rate: float | None = None
    moe_routing: str | None = None  # learned | balanced
    moe_experts: str | None = None  # grouped | loop

    def moe_options(self) -> dict:
        """The MoE flags given, by the spec's field names (empty: none given)."""
        names = {"moe_balance": "balance", "moe_aux_coef": "aux_coef", "moe_balance_rows": "balance_rows",
                 "moe_bias_rate": "bias_rate", "moe_routing": "routing", "moe_experts": "experts"}
        return {field: getattr(self, flag) for flag, field in names.items() if getattr(self, flag) is not None}

    def spec(self):
        """The preset with this configuration's changes (validated first: `validate`)."""
        spec = spec_of(self.name, self.mlp_hidden)
        return family_of(spec).with_options(spec, moe=self.moe_options()) if self.moe_options() else spec


# The [layout] section: the typed layout below the command line (`parallel.options.Layout`),
# which the planner and the strategies take too.
LayoutConfig = Layout


@dataclass
class TrainConfig:
    data: str = "shakespeare"
    steps: int = 300
    batch_size: int = 8  # global, in sequences (samples), whatever the layout
    seq_len: int = 128
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 20
    clip: float = 1.0  # global-norm clipping; 0 disables it
    weight_decay: float = 0.1
    seed: int = 0
    device: str = "auto"  # auto: CUDA when present (one GPU per local rank), else CPU
    out: str = "runs/latest"
    resume: bool = False  # from the latest good checkpoint in `out`
    resume_from: str | None = None  # from this checkpoint folder
    overwrite: bool = False  # a fresh run into an `out` holding another run's checkpoints moves them aside
    save_every: int | None = None  # a sharded checkpoint every N steps (and at the end)
    keep: int | None = None  # the newest K checkpoints kept (None: all)
    async_save: bool = False  # checkpoints written by a thread while training goes on
    skip_nonfinite: bool = False  # a non-finite loss or gradient norm skips the step (default: stops the run)
    max_restarts: int = 0  # meshtrain's own launch: restart the ranks after one fails, resuming
    eval_every: int | None = None  # the held-out loss every N steps (and at the end)
    eval_batches: int = 4  # global batches of the held-out split per evaluation
    tensorboard: bool = False  # TensorBoard events in OUT/tensorboard (the optional `tensorboard` package)
    vocab_size: int = 2048  # BPE vocabulary trained on the corpus; 256 means the byte tokenizer
    pad_documents: bool = False  # rows start at documents' starts, padded (loss-masked), instead of packed windows
    sample_tokens: int = 120
    # Seconds a collective may wait before the job fails (every rank, every mesh group), once
    # the first step is done; up to then at least START_TIMEOUT_S (building, first gathers).
    timeout: float = 100.0
    # verify only: save after step K and resume (in `resume_layout`, "tp=2 pp=2 zero=1", or the
    # same layout when None) before going on; `resumed_config` makes the second part's config.
    resume_at: int | None = None
    resume_layout: str | None = None


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    # The (section, field) pairs a user named, by flag or in the TOML file (`load` records
    # them; a Config made in code names none): what --init-from must not silently override.
    given: ClassVar[frozenset] = frozenset()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        cfg = cls()
        apply_sections(cfg, d, source="config")
        return cfg


# (flag, section, field, type, help) — the command-line contract of DESIGN.md.
FLAGS = [
    ("--model", "model", "name", str, f"model preset: {', '.join(PRESETS)}"),
    ("--init-from", "model", "init_from", str, "a Hugging Face folder of a Llama, Mixtral, Qwen3-MoE or OLMoE "
     "(config.json, safetensors, "
     "tokenizer.json): train from its weights, on --data tokenized by its tokenizer (the model and its vocabulary "
     "are that folder's: --vocab-size is refused, --seq-len up to its max_position_embeddings)"),
    ("--dropout", "model", "dropout", float, "dropout probability of the GPT, in [0, 1); masks drawn per sample "
     "from the seed, the same in every layout"),
    ("--mlp-hidden", "model", "mlp_hidden", str, "hidden widths of --model mlp, comma-separated, e.g. 1024,1024 "
     "(default 128,128,128)"),
    ("--attention", "model", "attention", str, "sdpa (fused kernel) | math (the score matrix materialised; "
     "the only path with attention-probability dropout)"),
    ("--moe-balance", "model", "moe_balance", str, "a mixture of experts' load balancing: sequence (DeepSeek-V3's "
     "per-row auxiliary loss, the default) | batch (Switch/GShard's, per --moe-balance-rows rows) | bias "
     "(auxiliary-loss-free: a per-expert bias on the scores, moved after each step) | none"),
    ("--moe-aux-coef", "model", "moe_aux_coef", float, "the auxiliary loss's weight (per token, as the "
     "cross-entropy's; 1 when balanced; default 0.001)"),
    ("--moe-balance-rows", "model", "moe_balance_rows", int, "--moe-balance batch: the rows each loss is taken "
     "over (a divisor of every micro-batch's rows, so that every layout computes the same loss)"),
    ("--moe-bias-rate", "model", "moe_bias_rate", float, "--moe-balance bias: how far each expert's bias moves "
     "per step (default 0.001)"),
    ("--moe-routing", "model", "moe_routing", str, "learned (the router's top-k) | balanced (tokens dealt to the "
     "experts in turn, weights still the router's: a fixed load for benchmarks and planner checks)"),
    ("--moe-experts", "model", "moe_experts", str, "grouped (torch's grouped_mm, the default) | loop (one "
     "matmul per expert)"),
    ("--data", "train", "data", str, "'shakespeare' (bundled), 'digits' (for --model mlp), a text file/folder, or a "
     "token folder written by `meshtrain prepare` (docs/data.md)"),
    ("--dp", "layout", "dp", int, "data-parallel size (default: fill the world; 2 from a shell when tp=pp=1)"),
    ("--tp", "layout", "tp", int, "tensor-parallel size"),
    ("--cp", "layout", "cp", int, "context-parallel size: each sequence split over cp ranks, attention by a ring of "
     "keys and values (--seq-len divisible by 2·cp)"),
    ("--cp-mode", "layout", "cp_mode", str, "ring (the default: keys and values travel a ring) | ulysses (all-to-all: "
     "each rank attends with n_heads/cp heads over the whole sequence); both head-tail balanced"),
    ("--pp", "layout", "pp", int, "pipeline-parallel size"),
    ("--ep", "layout", "ep", int, "expert-parallel size: each MoE layer's experts split over ep ranks, folded over "
     "the dp·cp·tp ranks (no ranks added: --dp 2 --ep 2 is 2 ranks); tokens travel to their experts by all-to-all"),
    ("--zero", "layout", "zero", int, "ZeRO stage inside the dp group: 0 (plain DP) | 1 (optimizer states "
     "sharded) | 2 (and gradients) | 3 (and parameters: FSDP, gathered per block)"),
    ("--keep-gathered", "layout", "keep_gathered", bool, "ZeRO-3: keep each block's parameters gathered from its "
     "forward to its backward (one all-gather less per block, more memory)"),
    ("--sp", "layout", "sp", bool, "sequence parallelism inside the TP group (needs --tp 2 or more)"),
    ("--schedule", "layout", "schedule", str, "pipeline schedule: " + "|".join(SCHEDULES)),
    ("--chunks", "layout", "chunks", int, "model chunks per pipeline stage (interleaved)"),
    ("--microbatches", "layout", "microbatches", int, "micro-batches per step and DP rank (accumulated)"),
    ("--recompute", "layout", "recompute", str, "activation checkpointing: none | full (each block keeps its "
     "input) | selective (the attention core is recomputed) | segments[:K] (every K-th block boundary kept; "
     "K = ceil(sqrt(blocks)) by default)"),
    ("--precision", "layout", "precision", str, "|".join(PRECISIONS) + " (bf16: fp32 master weights and moments)"),
    ("--grad-dtype", "layout", "grad_dtype", str, "fp32 (default: under bf16, gradients accumulated over "
     "micro-batches and reduced over dp in fp32) | compute (in bf16: 2 bytes a parameter and half the "
     "gradient traffic, less exact)"),
    ("--dp-linear-sync", "layout", "dp_linear_sync", str, "|".join(LINEAR_SYNCS) + ": per linear layer, how data "
     "parallelism makes its weight gradient whole: all-reduce it, or all-gather the layer's inputs and "
     "output-gradients and form it locally (fewer bytes when the global rows B < 2·n_in·n_out/(n_in+n_out)); "
     "auto picks the cheaper per layer"),
    ("--bucket-mb", "layout", "bucket_mb", float, "DP gradient bucket size in MB"),
    ("--compile", "layout", "compile", bool, "torch.compile each block's forward (after tensor parallelism, before "
     "checkpointing and ZeRO; collectives stay eager between compiled graphs; docs/compile.md)"),
    ("--compile-backend", "layout", "compile_backend", str, "with --compile: " + " | ".join(COMPILE_BACKENDS) +
     " (inductor, the default, generates kernels; aot_eager traces and differentiates without generating code)"),
    ("--stage-layers", "layout", "stage_layers", str, "blocks per pipeline (virtual) stage, e.g. 3,3,2 "
     "(default: as even as possible)"),
    ("--steps", "train", "steps", int, "optimizer steps"),
    ("--batch-size", "train", "batch_size", int, "global batch in sequences, whatever the layout"),
    ("--seq-len", "train", "seq_len", int, "tokens per sequence (with --init-from at most the folder's "
     "max_position_embeddings)"),
    ("--lr", "train", "lr", float, "peak learning rate (warm-up then cosine)"),
    ("--warmup", "train", "warmup", int, "warm-up steps"),
    ("--clip", "train", "clip", float, "global gradient-norm clip (0: off)"),
    ("--timeout", "train", "timeout", float, "seconds a collective may wait before the job fails with the rank "
                                             "named (default 100; up to the first step at least 300)"),
    ("--seed", "train", "seed", int, "seed of weights and batches"),
    ("--device", "train", "device", str, "|".join(DEVICES) + " (auto: CUDA when present, one GPU per local rank)"),
    ("--out", "train", "out", str, "output folder (metrics.jsonl, loss.png, model)"),
    ("--resume", "train", "resume", bool, "resume from the latest good checkpoint in OUT, in any layout"),
    ("--resume-from", "train", "resume_from", str, "resume from this checkpoint folder (a step-N of any run "
     "of the same model and global batch, in any layout)"),
    ("--overwrite", "train", "overwrite", bool, "start a fresh run in an OUT that holds another run's checkpoints "
     "(refused without it): they and its log are moved aside into OUT/replaced-<time>/, not deleted"),
    ("--save-every", "train", "save_every", int, "write a sharded checkpoint OUT/step-N every N steps and at "
     "the end (every rank writes what it owns)"),
    ("--keep", "train", "keep", int, "keep the newest K checkpoints (default: all)"),
    ("--async-save", "train", "async_save", bool, "write each checkpoint in the background: the step blocks only "
     "while the state is copied aside (host memory the size of each rank's state; pinned on a GPU); needs "
     "--save-every, and --keep 2 or more"),
    ("--max-restarts", "train", "max_restarts", int, "when a rank dies, restart all ranks up to N times, each "
     "resuming from the latest good checkpoint (under an outside torchrun, use torchrun's own --max-restarts)"),
    ("--eval-every", "train", "eval_every", int, "the loss on the held-out split (the last 1%% of the data, never "
     "trained on) every N steps and at the end: val_loss in metrics.jsonl, loss.png and --json"),
    ("--eval-batches", "train", "eval_batches", int, "global batches per evaluation (default 4)"),
    ("--tensorboard", "train", "tensorboard", bool, "write TensorBoard events to OUT/tensorboard: losses, "
     "learning rate, tokens/s, gradient norm, each rank's memory (pip install 'meshtrain[tb]')"),
    ("--skip-nonfinite", "train", "skip_nonfinite", bool, "skip (and count) a step whose loss or gradient norm "
     "is not finite, instead of stopping the run"),
    ("--vocab-size", "train", "vocab_size", int, "BPE vocabulary size (256: byte tokenizer); not with "
     "--init-from, whose tokenizer's it is"),
    ("--pad-documents", "train", "pad_documents", bool, "each row starts at a document's start (a file, or a "
     ".jsonl line; a longer document is cut into several rows) and is padded to --seq-len, the padding left out "
     "of the loss, instead of random windows across documents (packing)"),
    ("--resume-at", "train", "resume_at", int, "verify only: save after step K (into a temporary folder) and "
     "resume from it before going on, compared with one process trained straight through"),
    ("--resume-layout", "train", "resume_layout", str, "verify only, with --resume-at: the layout the run resumes "
     "in, written as its flags, e.g. \"tp=2 pp=2 zero=1 sp schedule=gpipe\" (keys not named take their defaults; "
     "an unset dp fills the first layout's world; default: the same layout)"),
]

_SECTION_TYPES = {"model": ModelConfig, "layout": LayoutConfig, "train": TrainConfig}


def _flag_of(section: str, name: str) -> str:
    for flag, sec, fld, _, _ in FLAGS:
        if (sec, fld) == (section, name):
            return flag
    return f"[{section}] {name}"


def _coerce(value, typ, where: str):
    if typ is bool:
        if isinstance(value, bool):
            return value
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(value, typ):
        return value
    elif typ is str and isinstance(value, list) and value and all(type(v) is int for v in value):
        return ",".join(str(v) for v in value)  # TOML's [1024, 1024] for "1024,1024"
    raise ConfigError(f"{where} must be {typ.__name__}, got {value!r}")


def _field_type(annotation: str) -> type:
    """The plain type of a dataclass field ('int | None' -> int): annotations are strings here."""
    return {"int": int, "float": float, "bool": bool, "str": str}[annotation.replace(" | None", "")]


def apply_sections(cfg: Config, d: dict, source: str) -> None:
    """Set fields from a {section: {field: value}} mapping, rejecting unknown names."""
    for section, values in d.items():
        if section not in _SECTION_TYPES or not isinstance(values, dict):
            raise ConfigError(f"{source}: unknown section [{section}]; use [model], [layout] or [train]")
        target = getattr(cfg, section)
        types = {f.name: f.type for f in dataclasses.fields(_SECTION_TYPES[section])}
        for name, value in values.items():
            if name not in types:
                raise ConfigError(f"{source}: unknown key '{name}' in [{section}]; known: {', '.join(types)}")
            if value is None and "None" in types[name]:  # an optional field left unset (a saved config)
                setattr(target, name, None)
                continue
            setattr(target, name, _coerce(value, _field_type(types[name]), f"{source}: [{section}] {name}"))


def load(path: str | None, overrides: dict[tuple[str, str], object],
         defaults: dict[tuple[str, str], object] | None = None) -> Config:
    """The built-in defaults, then a command's own `defaults` (verify takes 10 steps), then the
    TOML file, then the command-line overrides."""
    cfg = Config()
    for (section, name), value in (defaults or {}).items():
        setattr(getattr(cfg, section), name, value)
    given = set(overrides)
    if path:
        if not os.path.isfile(path):
            raise ConfigError(f"--config {path}: no such file")
        try:
            with open(path, "rb") as f:
                sections = tomllib.load(f)
            apply_sections(cfg, sections, source=path)
            given |= {(section, name) for section, values in sections.items() for name in values}
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"--config {path}: not valid TOML ({e})") from None
        except UnicodeDecodeError:
            raise ConfigError(f"--config {path}: not UTF-8 text; give a TOML file") from None
    for (section, name), value in overrides.items():
        setattr(getattr(cfg, section), name, value)
    cfg.given = frozenset(given)
    return cfg


def fill_dp(lay: LayoutConfig, world_size: int | None) -> None:
    """An unset --dp fills the world: under a launcher world ÷ (tp·pp·cp); from a shell 2 for
    the default job (tp = pp = cp = 1), else 1, so that `train --pp 2` starts 2 ranks, not 4 —
    or, with --ep, the least multiple of that whose dp·cp·tp ranks ep divides (`--ep 4`: dp 4)."""
    if lay.dp is not None:
        return
    rest = lay.tp * lay.pp * lay.cp
    if world_size is None:
        base = 2 if rest == 1 else 1
        lay.dp = math.lcm(base, lay.ep // math.gcd(lay.ep, lay.cp * lay.tp))
    elif world_size % rest:
        raise ConfigError(f"the launcher started {world_size} processes, not a multiple of tp×pp×cp = "
                          f"{lay.tp}×{lay.pp}×{lay.cp} = {rest}; change --tp/--pp/--cp or the number of processes")
    else:
        lay.dp = world_size // rest


START_TIMEOUT_S = 300.0  # the collective timeout up to the first step (at least)
STRICT_P2P_ENV = "MESHTRAIN_STRICT_P2P"


def strict_p2p_requested(environ=None) -> bool:
    """Whether `MESHTRAIN_STRICT_P2P` (unset, 0 or 1) asks pipelines to check their transfers
    under NCCL's rules on gloo (`parallel/pipeline/transport.py`)."""
    value = (os.environ if environ is None else environ).get(STRICT_P2P_ENV, "0").strip()
    if value not in ("0", "1", ""):
        raise ConfigError(f"{STRICT_P2P_ENV}={value!r}: use 1 (point-to-point checked under NCCL's rules) or 0")
    return value == "1"


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
    add_preset(name, spec)
    m.name, cfg.train.vocab_size = name, vocab


def imported_tokenizer(cfg: Config) -> Path | None:
    """--init-from's tokenizer.json, or None (a BPE trained on the text)."""
    return Path(cfg.model.init_from, "tokenizer.json") if cfg.model.init_from else None


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
            raise ConfigError(f"{_flag_of(section, name)} {value}: must be a positive integer")
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
    if lay.keep_gathered and lay.zero != 3:
        raise ConfigError("--keep-gathered applies to --zero 3 (the only stage that frees parameters); drop it")
    if world_size is not None and world_size != lay.world_size:
        raise ConfigError(f"the launcher started {world_size} processes but dp×cp×tp×pp = {lay.dp}×{lay.cp}×{lay.tp}"
                          f"×{lay.pp} = {lay.world_size}; change --dp/--cp/--tp/--pp so that their product is "
                          f"{world_size}")
    if lay.cp > 1:
        _validate_context(cfg, user_model)
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
                                    micro_rows=tr.batch_size // (lay.dp * lay.microbatches))
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
    if tr.max_restarts and not tr.save_every and command == "train":
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


def parse_layout(text: str, flag: str = "--resume-layout") -> dict[str, object]:
    """A layout written as its flags without dashes — "tp=2 pp=2 zero=1 sp schedule=gpipe" —
    as {LayoutConfig field: value} of the keys named (a bare key switches a flag on; `sp=0`
    off); one line for an unknown key or a bad value."""
    keys = {f.lstrip("-"): (name, typ) for f, section, name, typ, _ in FLAGS if section == "layout"}
    given: dict[str, object] = {}
    for token in text.split():
        key, eq, value = token.partition("=")
        key = key.lstrip("-").replace("_", "-")
        if key not in keys:
            raise ConfigError(f"{flag} {text!r}: unknown key '{key}'; use {', '.join(keys)}")
        name, typ = keys[key]
        if typ is bool:
            if eq and value.lower() not in ("1", "0", "true", "false"):
                raise ConfigError(f"{flag}: {token}: write '{key}' to switch it on, '{key}=0' off")
            given[name] = not eq or value.lower() in ("1", "true")
            continue
        try:
            given[name] = typ(value) if eq and value else None
        except ValueError:
            given[name] = None
        if given[name] is None:
            raise ConfigError(f"{flag}: {token}: give {key}=<{typ.__name__}>")
    if not given:
        raise ConfigError(f"{flag}: name a layout, e.g. \"tp=2 pp=2 zero=1\"")
    return given


# What --resume-layout inherits from the first layout: verify's one-process reference trains
# in one precision throughout, so both parts must train in it (a plain resume may change it).
RESUME_KEEPS = ("precision",)


def resumed_config(cfg: Config, world_size: int | None = None) -> Config | None:
    """`verify --resume-at K [--resume-layout L]`: the configuration the run resumes in after
    step K (None without --resume-at), validated; `cfg` is the first part's, validated. L's
    keys not named take their defaults, as on a command line — but for `RESUME_KEEPS`, which
    the reference holds equal and so come from the first layout — and an unset dp fills the
    first layout's world where tp·pp·cp divides it (else 1). From a shell meshtrain starts each
    part's own ranks, so the worlds may differ; under a launcher (`world_size`) the resumed
    part runs in the same processes, so L must fill that world."""
    tr = cfg.train
    if tr.resume_at is None:
        if tr.resume_layout:
            raise ConfigError("--resume-layout names the layout a resume continues in; give --resume-at K too")
        return None
    if not 1 <= tr.resume_at < tr.steps:
        raise ConfigError(f"--resume-at {tr.resume_at}: save after a step from 1 to {tr.steps - 1} (--steps "
                          f"{tr.steps}), so that steps are left to run resumed")
    if tr.resume or tr.resume_from or tr.save_every:
        raise ConfigError("verify --resume-at saves and resumes by itself, in a temporary folder; drop --resume, "
                          "--resume-from and --save-every")
    second = Config(model=dataclasses.replace(cfg.model), layout=dataclasses.replace(cfg.layout),
                    train=dataclasses.replace(cfg.train))
    if tr.resume_layout is not None:
        kept = {name: getattr(cfg.layout, name) for name in RESUME_KEEPS}
        second.layout = LayoutConfig(**{**kept, **parse_layout(tr.resume_layout)})
    lay, where = second.layout, f"--resume-layout {tr.resume_layout!r}"
    world, rest = world_size or cfg.layout.world_size, lay.tp * lay.pp * lay.cp
    if lay.dp is None:
        lay.dp = world // rest if world % rest == 0 else 1
    if world_size is not None and lay.world_size != world_size:
        raise ConfigError(f"{where}: dp×cp×tp×pp = {lay.dp}×{lay.cp}×{lay.tp}×{lay.pp} = {lay.world_size}, but the "
                          f"launcher started {world_size} processes; under a launcher the run resumes in the same "
                          f"processes, so give a layout of {world_size} ranks (from a shell meshtrain starts each "
                          f"part's own)")
    if lay.precision != cfg.layout.precision:
        raise ConfigError(f"{where}: precision {lay.precision}, but the run saved in {cfg.layout.precision}; "
                          f"write precision={cfg.layout.precision} there")
    try:
        validate(second, world_size)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    return second


def tokens_per_sample(cfg: Config) -> int:
    """Loss terms per sample: one per token for text, one per image (the MLP, or digits)."""
    name = cfg.model.name
    images = cfg.train.data == "digits" or (is_preset(name) and family_of(PRESETS[name]).inputs == "features")
    return 1 if images else cfg.train.seq_len


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to `lr`, then cosine decay to `lr * min_lr_ratio` at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(1, cfg.steps - cfg.warmup)
    progress = min(1.0, (step - cfg.warmup) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1 + math.cos(math.pi * progress))

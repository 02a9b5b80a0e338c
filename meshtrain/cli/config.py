"""The command line's configuration: dataclasses for the model, the parallel layout and
training; a TOML file sets any field, command-line flags override it (`load`, `from_args`).
`cli.validate` then rejects a bad one with one line naming the flag to change, before any
process starts; `cli.resume_at` makes `verify --resume-at`'s second part.

No torch import here: a bad flag must fail in a fraction of a second."""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from dataclasses import dataclass, field
from typing import ClassVar
from pathlib import Path

from meshtrain.recipes import PRESETS, family_of, is_preset, spec_of
from meshtrain.parallel.options import (COMPILE_BACKENDS, FP8_RECIPES, LINEAR_SYNCS, PRECISIONS, SCHEDULES, ConfigError,
                                       Layout)

ATTENTIONS = ("sdpa", "math")
DEVICES = ("auto", "cpu", "cuda")
BUILTIN_DATA = ("shakespeare", "digits")
COMMAND_STEPS = {"verify": 10, "bench": 20}  # their default --steps, unless TOML or a flag says
# bench --vs: meshtrain.bench.PEERS, named here so that a bad --vs fails without torch
BENCH_PEERS = ("ddp", "zero1", "fsdp2", "dtensor-tp", "torch-pp")


@dataclass
class ModelConfig:
    name: str = "gpt-small"
    dropout: float = 0.0  # on the embedding, attention output, MLP output (and attention probabilities on `math`)
    attention: str = "sdpa"
    mlp_hidden: str = ""  # the MLP's hidden widths, e.g. "1024,1024"; empty: the preset's
    init_from: str | None = None  # a Hugging Face folder (Llama, Mixtral, Qwen3-MoE, OLMoE): its architecture, weights, tokenizer
    # A mixture-of-experts preset's routing and balancing (None: the preset's own).
    moe_balance: str | None = None  # sequence | batch | pooled | bias | none
    moe_aux_coef: float | None = None
    moe_balance_rows: int | None = None  # the batch loss's group of rows
    moe_bias_rate: float | None = None
    moe_routing: str | None = None  # learned | balanced
    moe_experts: str | None = None  # grouped | loop
    moe_capacity: float | None = None  # each expert's share of a sequence's choices (None: dropless)

    def moe_options(self) -> dict:
        """The MoE flags given, by the spec's field names (empty: none given)."""
        names = {"moe_balance": "balance", "moe_aux_coef": "aux_coef", "moe_balance_rows": "balance_rows",
                 "moe_bias_rate": "bias_rate", "moe_routing": "routing", "moe_experts": "experts",
                 "moe_capacity": "capacity"}
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
    optimizer: str = "adamw"  # adamw | adamw8bit | adamw4bit | adamwfp8 (torchao's low-bit moments)
    seed: int = 0
    device: str = "auto"  # auto: CUDA when present (one GPU per local rank), else CPU
    out: str = "runs/latest"
    resume: bool = False  # from the latest good checkpoint in `out`
    resume_from: str | None = None  # from this checkpoint folder
    overwrite: bool = False  # a fresh run into an `out` holding another run's checkpoints moves them aside
    save_every: int | None = None  # a sharded checkpoint every N steps (and at the end)
    keep: int | None = None  # the newest K checkpoints kept (None: all)
    async_save: bool = False  # checkpoints written by a thread while training goes on
    async_pageable: bool = False  # --async-save's staging in pageable host memory, not pinned
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
class SearchConfig:
    """`train --layout-search` (TOML: `[layout] search = true`, the rest in `[search]`): the
    planner proposes, a short profile on the real ranks decides (`meshtrain.layout_search`)."""
    enabled: bool = False
    world: int | None = None  # from a shell: how many local ranks to start (default 2)
    candidates: int = 3  # the K fastest predicted layouts that fit, profiled
    memory_per_rank: str | None = None  # "12GiB", "800MiB", bytes; default: the device's less headroom, or the host's share
    mem_headroom: float = 0.1  # the fraction of a GPU's memory kept free (the CUDA context, the allocator)
    budget: float = 600.0  # seconds the whole profile may take
    reprofile: bool = False  # measure again, even where this machine measured this model before
    machine: str | None = None  # a machine profile (`plan --calibrate`) the planner predicts with


@dataclass
class FtConfig:
    """`train --ft-replicas R` (TOML `[ft]`): R replica groups of the layout, each step's
    gradients summed over the live ones through torchft (`meshtrain.replicas`)."""
    replicas: int = 0  # 0: off
    replica_id: int | None = None  # this group's index; from a shell meshtrain's launcher sets it
    lighthouse: str | None = None  # torchft's lighthouse; from a shell meshtrain starts one
    timeout: float = 60.0  # seconds torchft's collectives and commit vote wait
    quorum_timeout: float = 60.0  # seconds a step waits for its quorum
    heartbeat_timeout: float = 5.0  # seconds without a heartbeat before the local lighthouse drops a group
    bucket_mb: float = 25.0  # MiB of gradients per all-reduce over the groups


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    ft: FtConfig = field(default_factory=FtConfig)
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
     "per-row auxiliary loss, the default) | batch (Switch/GShard's, per --moe-balance-rows rows) | pooled "
     "(transformers' loss, pooled over each forward's layers and tokens, for fine-tuning its folders exactly; "
     "not with --pp) | bias "
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
    ("--moe-capacity", "model", "moe_capacity", float, "a capacity factor F: each expert takes at most "
     "ceil(F·s·k/E) of a sequence's s·k choices, the highest-weighted first, and drops the rest (default: "
     "dropless; not with --cp or --sp)"),
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
    ("--ep-max-load", "layout", "ep_max_load", float, "a bound on the rows a rank's experts receive, F times the "
     "balanced share: a layer whose routing would send more stops every rank with one line before the rows move "
     "(default: no bound; the planner then assumes balance)"),
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
    ("--fp8", "layout", "fp8", str, "none | " + " | ".join(FP8_RECIPES) + ": the blocks' linear layers' matmuls in "
     "float8 on torchao's recipe (tensorwise: a scale per tensor; rowwise: per row), with whole tensors' scales in "
     "every layout (needs pip install 'meshtrain[fp8]'; docs/fp8.md)"),
    ("--fp8-emulate", "layout", "fp8_emulate", bool, "with --fp8: torchao's emulation of the fp8 matmuls, for a "
     "device without them (CPU; GPUs before compute capability 8.9): the same numerics, slower than fp32"),
    ("--fp8-min-features", "layout", "fp8_min_features", int, "with --fp8: the smallest side (in or out features) "
     "of a linear layer it converts (default 1024; smaller ones lose to their casts; both sides must be multiples "
     "of 16)"),
    ("--stage-layers", "layout", "stage_layers", str, "blocks per pipeline (virtual) stage, e.g. 3,3,2 "
     "(default: as even as possible)"),
    ("--steps", "train", "steps", int, "optimizer steps"),
    ("--batch-size", "train", "batch_size", int, "global batch in sequences, whatever the layout"),
    ("--seq-len", "train", "seq_len", int, "tokens per sequence (with --init-from at most the folder's "
     "max_position_embeddings)"),
    ("--lr", "train", "lr", float, "peak learning rate (warm-up then cosine)"),
    ("--optimizer", "train", "optimizer", str, "adamw (the default: fp32 moments, 8 bytes a parameter) | adamw8bit | "
     "adamw4bit | adamwfp8: torchao's AdamW with both moments in 8 bits, 4 bits or fp8 per block of 256 (128) "
     "elements, about 2.03, 1.06, 2.03 bytes a parameter; sharded by ZeRO and resumed in any layout exactly "
     "(needs pip install 'meshtrain[fp8]'; docs/fp8.md)"),
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
    ("--async-save-pageable", "train", "async_pageable", bool, "--async-save's copy in pageable host memory "
     "instead of pinned (a host short of pinnable memory; the copy from a GPU is then slower)"),
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

# `train` alone: --layout-search and the flags that shape it (the other commands take a layout).
SEARCH_FLAGS = [
    ("--layout-search", "search", "enabled", bool, "search the layout: the planner ranks every valid layout of "
     "the world (the layout flags given fix their axes), the --candidates fastest that fit are profiled for a few "
     "steps on these ranks, and the run trains with the fastest measured (OUT/layout-search.json)"),
    ("--world", "search", "world", int, "with --layout-search from a shell: the local ranks to start (default 2; "
     "under a launcher the world is the launcher's)"),
    ("--candidates", "search", "candidates", int, "with --layout-search: the layouts profiled (default 3)"),
    ("--memory-per-rank", "search", "memory_per_rank", str, "with --layout-search: the memory a rank may fill, "
     "e.g. 12GiB or 800MiB (default: the GPU's memory less 10%%; on the CPU the host's available memory over "
     "its local ranks)"),
    ("--mem-headroom", "search", "mem_headroom", float, "with --layout-search on a GPU: the fraction of its memory "
     "kept free for the CUDA context and the allocator's cache (default 0.1), as `plan --mem-headroom`"),
    ("--search-budget", "search", "budget", float, "with --layout-search: seconds the profile may take; a "
     "candidate that would run past them is skipped"),
    ("--reprofile", "search", "reprofile", bool, "with --layout-search: profile again where this machine already "
     "measured the model, world and batch (their measurements are otherwise reused)"),
    ("--machine", "search", "machine", str, "with --layout-search: the machine profile the planner predicts with "
     "(`meshtrain plan --calibrate`; default on the CPU: this host's, measured once into the cache)"),
]

# `train` alone: per-step fault tolerance over replica groups (torchft; docs/fault-tolerance.md).
FT_FLAGS = [
    ("--ft-replicas", "ft", "replicas", int, "train R replica groups of the layout, fault tolerant: each step's "
     "gradients are summed over the live groups through torchft, a lost group's peers go on, and a restarted "
     "one heals from a live peer (needs pip install 'meshtrain[ft]')"),
    ("--ft-replica-id", "ft", "replica_id", int, "with --ft-replicas under a launcher: this group's index, 0 to "
     "R-1 (from a shell meshtrain starts the groups itself)"),
    ("--ft-lighthouse", "ft", "lighthouse", str, "with --ft-replicas: torchft's lighthouse, http://HOST:PORT "
     "(default: the TORCHFT_LIGHTHOUSE variable; from a shell meshtrain starts one)"),
    ("--ft-timeout", "ft", "timeout", float, "with --ft-replicas: seconds an all-reduce over the groups and the "
     "commit vote may wait"),
    ("--ft-quorum-timeout", "ft", "quorum_timeout", float, "with --ft-replicas: seconds a step may wait for its "
     "quorum of live groups"),
    ("--ft-heartbeat-timeout", "ft", "heartbeat_timeout", float, "with --ft-replicas from a shell: seconds without "
     "a heartbeat before the lighthouse drops a group (what a survivor stalls, at least, per failure)"),
    ("--ft-bucket-mb", "ft", "bucket_mb", float, "with --ft-replicas: MiB of gradients per all-reduce over the groups"),
]

_SECTION_TYPES = {"model": ModelConfig, "layout": LayoutConfig, "train": TrainConfig, "search": SearchConfig,
                  "ft": FtConfig}


def flag_of(section: str, name: str) -> str:
    for flag, sec, fld, _, _ in FLAGS + SEARCH_FLAGS + FT_FLAGS:
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
            raise ConfigError(f"{source}: unknown section [{section}]; use [model], [layout], [train], [search] or [ft]")
        target = getattr(cfg, section)
        types = {f.name: f.type for f in dataclasses.fields(_SECTION_TYPES[section])}
        for name, value in values.items():
            if (section, name) == ("layout", "search"):  # `[layout] search = true`: --layout-search
                cfg.search.enabled = _coerce(value, bool, f"{source}: [layout] search")
                continue
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
            given |= {("search", "enabled") if (section, name) == ("layout", "search") else (section, name)
                      for section, values in sections.items() for name in values}
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

def imported_tokenizer(cfg: Config) -> Path | None:
    """--init-from's tokenizer.json, or None (a BPE trained on the text)."""
    return Path(cfg.model.init_from, "tokenizer.json") if cfg.model.init_from else None


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


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def from_args(args) -> Config:
    """The configuration that parsed run flags (`cli.build_parser`) describe: the defaults, the
    command's own (`COMMAND_STEPS`), the `--config` TOML file, then the flags given."""
    given = {(sec, name): getattr(args, _dest(flag), None)
             for flag, sec, name, _, _ in FLAGS + SEARCH_FLAGS + FT_FLAGS}
    overrides = {key: value for key, value in given.items() if value is not None}
    defaults = {("train", "steps"): COMMAND_STEPS[args.command]} if args.command in COMMAND_STEPS else {}
    return load(args.config, overrides, defaults)

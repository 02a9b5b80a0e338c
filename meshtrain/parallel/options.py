"""The strategies' own typed options: what `parallelize` applies, independent of the command
line (the CLI's `LayoutConfig` and the Python API both translate into this), and the
`Layout` a run is planned and trained in (the command line's `[layout]` section is this
class, `cli.config.LayoutConfig`), with what every user of a layout refuses in it
(`schedule_or_batch_problem`), and a layout's text form (`parse_layout`: the grammar of
`verify --resume-layout` and of `meshtrain.verify(resume_layout=...)`). No torch: the command
line validates with these."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")
PRECISIONS = ("fp32", "bf16")
GRAD_DTYPES = ("compute", "fp32")
LINEAR_SYNCS = ("allreduce", "allgather", "auto")
CP_MODES = ("ring", "ulysses")  # context parallelism's attention
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
FP8_RECIPES = ("tensorwise", "rowwise")  # torchao's float8 training recipes (`parallel/fp8.py`)
# Below this many features on either side torchao's H100 tables show an fp8 matmul losing to
# its casts (its own auto filter skips layers of 1,024 or fewer output features).
FP8_MIN_FEATURES = 1024
# torchao's low-bit AdamW (`meshtrain/lowbit.py`): --optimizer name -> (its class, the block of
# elements that shares one scale)
LOW_BIT_OPTIMIZERS = {"adamw8bit": ("AdamW8bit", 256), "adamw4bit": ("AdamW4bit", 128), "adamwfp8": ("AdamWFp8", 256)}
OPTIMIZERS = ("adamw", *LOW_BIT_OPTIMIZERS)


def low_bit_bytes_per_element(kind: str) -> float:
    """A low-bit AdamW's state bytes per element of a quantized tensor: two moments' codes
    (1 byte, or half of one at 4 bits) and their blocks' fp32 scales."""
    block = LOW_BIT_OPTIMIZERS[kind][1]
    return 2 * ((0.5 if kind == "adamw4bit" else 1.0) + 4 / block)


class ConfigError(ValueError):
    """A configuration that cannot work; the message is one line that names the fix. The
    command line's refusals raise it (`meshtrain.cli.config.ConfigError` is this class), and
    so does a layout written as text that cannot be read (`parse_layout`)."""


@dataclass(frozen=True)
class CompileOptions:
    """How `compile=True` compiles each block (`parallel/compile.py`): `backend`, torch.compile's
    ("inductor" generates kernels; "aot_eager" traces and differentiates the graph without
    generating code: what the test suite runs)."""
    backend: str = "inductor"

    def __post_init__(self):
        if self.backend not in COMPILE_BACKENDS:
            raise ValueError(f"compile backend {self.backend!r}: use {', '.join(COMPILE_BACKENDS)}")


@dataclass(frozen=True)
class Fp8Options:
    """The blocks' linear layers' matmuls in float8 (`parallel/fp8.py`). `recipe`:
    "tensorwise" or "rowwise" (torchao's); `emulate`: torchao's emulation (a CPU, or a GPU
    without fp8 matmuls: the same numerics, slower than fp32); `min_features`: the smallest
    side a converted layer may have."""
    recipe: str = "tensorwise"
    emulate: bool = False
    min_features: int = FP8_MIN_FEATURES

    def __post_init__(self):
        if self.recipe not in FP8_RECIPES:
            raise ValueError(f"fp8 recipe {self.recipe!r}: use {' or '.join(FP8_RECIPES)}")
        if not isinstance(self.min_features, int) or self.min_features < 1:
            raise ValueError(f"fp8 min_features={self.min_features!r}: use an integer ≥ 1")

    @classmethod
    def of(cls, fp8) -> "Fp8Options | None":
        """`parallelize(fp8=...)`'s argument as options: None, a recipe's name, or options."""
        if fp8 is None or isinstance(fp8, cls):
            return fp8
        if isinstance(fp8, str):
            return cls(fp8)
        raise TypeError(f"fp8={fp8!r}: pass 'tensorwise', 'rowwise' or meshtrain.Fp8Options(...)")


@dataclass(frozen=True)
class Strategies:
    """How to parallelize a model on a mesh whose axis sizes are already fixed.

    `zero`: 0 (plain data parallelism) or the ZeRO stage 1-3; `precision`: "fp32" or "bf16"
    (fp32 masters); `grad_dtype`: "fp32" (gradients accumulated and reduced in fp32) or
    "compute" (in the compute dtype); `recompute`: none | full | selective | segments[:K];
    `sp`: sequence parallelism over tp; `schedule`, `chunks`, `microbatches`, `stage_layers`:
    the pipeline's; `bucket_mb`: data parallelism's bucket size; `keep_gathered`: ZeRO-3
    keeps a block's parameters from forward to backward; `dp_linear_sync`: allreduce |
    allgather | auto per linear layer; `strict_p2p`: check pipeline transfers under NCCL's
    rules on gloo; `cp_mode`: how attention runs when the mesh has cp > 1 ("ring")."""
    zero: int = 0
    precision: str = "fp32"
    grad_dtype: str = "fp32"
    recompute: str = "none"
    sp: bool = False
    schedule: str = "1f1b"
    chunks: int = 1
    microbatches: int = 1
    stage_layers: tuple[int, ...] | None = None
    bucket_mb: float = 25.0
    keep_gathered: bool = False
    dp_linear_sync: str = "allreduce"
    strict_p2p: bool = False
    cp_mode: str = "ring"
    compile: CompileOptions | None = None  # each block's forward compiled (None: eager)
    ep_max_load: float | None = None  # the most rows an ep rank may receive, × the balanced share (None: no bound)
    fp8: Fp8Options | None = None  # the blocks' linear layers' matmuls in float8 (None: not)

    def __post_init__(self):
        checks = [("zero", self.zero in (0, 1, 2, 3), "0, 1, 2 or 3"),
                  ("precision", self.precision in PRECISIONS, " or ".join(PRECISIONS)),
                  ("grad_dtype", self.grad_dtype in GRAD_DTYPES, " or ".join(GRAD_DTYPES)),
                  ("schedule", self.schedule in SCHEDULES, ", ".join(SCHEDULES)),
                  ("chunks", isinstance(self.chunks, int) and self.chunks >= 1, "an integer ≥ 1"),
                  ("microbatches", isinstance(self.microbatches, int) and self.microbatches >= 1, "an integer ≥ 1"),
                  ("dp_linear_sync", self.dp_linear_sync in LINEAR_SYNCS, ", ".join(LINEAR_SYNCS)),
                  ("cp_mode", self.cp_mode in CP_MODES, " or ".join(CP_MODES)),
                  ("ep_max_load", self.ep_max_load is None or self.ep_max_load >= 1,
                   "at least 1 (a rank always receives at least the balanced share somewhere)")]
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r}: use {allowed}")
        if self.fp8 is not None and self.schedule == "zb":
            raise ValueError("fp8 with the zero-bubble schedule: its split backward computes the linear layers' weight "
                             "gradients itself, in high precision; use schedule 1f1b, gpipe or interleaved")
        if self.fp8 is not None and self.dp_linear_sync != "allreduce":
            raise ValueError(f"fp8 with dp_linear_sync={self.dp_linear_sync!r}: the all-gather path forms the linear "
                             "layers' weight gradients itself, in high precision; use dp_linear_sync='allreduce'")
        try:
            parse_recompute(self.recompute)
        except ValueError:
            raise ValueError(f"recompute={self.recompute!r}: use none, full, selective or segments[:K]") from None


def parse_recompute(policy: str) -> tuple[str, int | None]:
    """'segments:3' -> ('segments', 3); 'segments' -> ('segments', None); 'full' -> ('full',
    None); ValueError for anything else."""
    mode, colon, k = policy.partition(":")
    if mode not in ("none", "full", "selective", "segments") or (colon and mode != "segments"):
        raise ValueError(policy)
    if colon:
        if not k.isdigit() or int(k) < 1:
            raise ValueError(policy)
        return mode, int(k)
    return mode, None


@dataclass
class Layout:
    """A run's parallel layout: the mesh's axis sizes and the strategies' options, as the
    command line's `[layout]` section (`cli.config.LayoutConfig`) and the planner take it."""
    # None: fill the world. Under a launcher world ÷ (tp·pp); from a shell 2 when tp = pp = 1
    # (the default job), else 1. `cli.validate.validate` fills it in.
    dp: int | None = None
    tp: int = 1
    pp: int = 1
    cp: int = 1  # context parallelism: each sequence split over cp ranks
    cp_mode: str = "ring"
    ep: int = 1  # expert parallelism: each MoE layer's experts split over ep ranks folded over dp·cp·tp
    zero: int = 0
    sp: bool = False
    schedule: str = "1f1b"
    chunks: int = 1
    microbatches: int = 1
    recompute: str = "none"
    precision: str = "fp32"
    # Under bf16: "fp32" accumulates gradients over micro-batches and reduces them over dp in
    # fp32 (Megatron's and torchtitan's default); "compute" keeps them in bf16 (half the bytes).
    grad_dtype: str = "fp32"
    bucket_mb: float = 25.0
    keep_gathered: bool = False  # ZeRO-3: keep each block's parameters gathered from forward to backward
    dp_linear_sync: str = "allreduce"  # per linear layer: all-reduce its weight gradient, or all-gather its rows
    stage_layers: str = ""  # blocks per virtual stage, e.g. "3,3,2"; empty: as even as possible
    compile: bool = False  # each block's forward compiled by torch.compile
    compile_backend: str = "inductor"
    ep_max_load: float | None = None  # expert parallelism: the bound on the rows a rank receives (× balanced)
    fp8: str = "none"  # none | tensorwise | rowwise: the blocks' linear layers' matmuls in float8 (torchao)
    fp8_emulate: bool = False  # torchao's emulation of the fp8 matmuls (a device without them: CPU)
    fp8_min_features: int = FP8_MIN_FEATURES  # the smallest side of a linear layer --fp8 converts

    def stage_layer_counts(self) -> list[int] | None:
        return [int(n) for n in self.stage_layers.split(",")] if self.stage_layers else None

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    def short(self) -> str:
        """One-line description for titles and logs."""
        sp = " sp" if self.sp else ""
        pp = f" {self.schedule}" + (f" chunks={self.chunks}" if self.chunks > 1 else "") if self.pp > 1 else ""
        zero = f" zero={self.zero}" if self.zero else ""
        cp = f" cp={self.cp} {self.cp_mode}" if self.cp > 1 else ""
        compiled = f" compile={self.compile_backend}" if self.compile else ""
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        fp8 = f" fp8={self.fp8}" if self.fp8 != "none" else ""
        return (f"dp={self.dp}{zero}{cp}{ep} tp={self.tp}{sp} pp={self.pp}{pp} microbatches={self.microbatches} "
                f"{self.precision}{fp8}{compiled}")

    def fp8_options(self):
        """`--fp8`'s options (`parallel.fp8.Fp8Options`), or None without it."""
        if self.fp8 == "none":
            return None
        return Fp8Options(self.fp8, emulate=self.fp8_emulate, min_features=self.fp8_min_features)

    def strategies(self, strict_p2p: bool = False) -> Strategies:
        """The strategies' own options for this layout (the axis sizes live on the mesh)."""
        return Strategies(zero=self.zero, precision=self.precision, grad_dtype=self.grad_dtype,
                          recompute=self.recompute, sp=self.sp, schedule=self.schedule, chunks=self.chunks,
                          microbatches=self.microbatches,
                          stage_layers=tuple(self.stage_layer_counts() or ()) or None,
                          bucket_mb=self.bucket_mb, keep_gathered=self.keep_gathered,
                          dp_linear_sync=self.dp_linear_sync, strict_p2p=strict_p2p, cp_mode=self.cp_mode,
                          compile=CompileOptions(self.compile_backend) if self.compile else None,
                          ep_max_load=self.ep_max_load, fp8=self.fp8_options())

    def summary(self) -> dict:
        """The `layout` object of the JSON contract."""
        keys = ("dp", "tp", "pp", "zero", "sp", "schedule", "microbatches", "recompute", "precision", "cp", "cp_mode",
                "compile", "ep", "fp8")
        return {k: getattr(self, k) for k in keys}


def schedule_or_batch_problem(lay: Layout, batch_size: int) -> str | None:
    """What `train` and `plan` both refuse in a layout's schedule and batch: one line, or None."""
    if lay.chunks > 1 and lay.schedule != "interleaved":
        return f"--chunks {lay.chunks} needs --schedule interleaved ({lay.schedule} runs one chunk per stage)"
    if lay.schedule == "interleaved" and lay.pp > 1 and lay.microbatches % lay.pp:
        return (f"--schedule interleaved takes micro-batches in groups of the {lay.pp} stages; "
                f"use --microbatches a multiple of {lay.pp}")
    per_step = lay.dp * lay.microbatches
    if batch_size % per_step:
        return (f"--batch-size {batch_size} is not divisible by dp×microbatches = {lay.dp}×{lay.microbatches} = "
                f"{per_step}; use a multiple of {per_step}")
    return None


def expert_problem(lay: Layout, experts: int | None, model: str, batch_size: int | None = None,
                   seq_len: int | None = None) -> str | None:
    """What `train` and `plan` both refuse in `--ep`, one line or None: ep folds over
    dp·cp·tp, divides the model's `experts` (None: not known yet — a user's model, counted
    where it is built), and without SP tp splits each micro-batch's tokens."""
    fold = lay.dp * lay.cp * lay.tp
    if fold % lay.ep:
        return (f"--ep {lay.ep} does not divide dp·cp·tp = {lay.dp}·{lay.cp}·{lay.tp} = {fold}: expert "
                f"parallelism folds over those ranks; use an --ep dividing {fold} (or a larger --dp)")
    if experts is None:
        return None
    if not experts:
        return (f"--ep {lay.ep}: expert parallelism splits a mixture of experts' experts, and {model} has none; use "
                "an MoE model (--model moe-test, moe-small) or drop --ep")
    if experts % lay.ep:
        return f"--ep {lay.ep} does not divide the {experts} experts of {model}; use an --ep dividing {experts}"
    if batch_size is not None and seq_len is not None and lay.tp > 1 and not lay.sp:
        rows = batch_size // (lay.dp * lay.microbatches)
        if (rows * seq_len // lay.cp) % lay.tp:
            return (f"--ep with --tp {lay.tp} and no --sp splits each micro-batch's {rows}×{seq_len // lay.cp} "
                    "tokens over tp; use a batch or --seq-len whose tokens tp divides")
    return None


_KEY_TYPES = {"int": int, "float": float, "bool": bool, "str": str}


def parse_layout(text: str, flag: str = "--resume-layout") -> dict[str, object]:
    """A layout written as its flags without dashes — "tp=2 pp=2 zero=1 sp schedule=gpipe" —
    as {Layout field: value} of the keys named (a bare key switches a flag on; `sp=0` off);
    one line (`ConfigError`) for an unknown key or a bad value. The keys are `Layout`'s
    fields, which are the command line's layout flags."""
    keys = {f.name.replace("_", "-"): (f.name, _KEY_TYPES[f.type.replace(" | None", "")])
            for f in dataclasses.fields(Layout)}
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

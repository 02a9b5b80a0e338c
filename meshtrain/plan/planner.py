"""One plan: a model, a layout and a batch on a cluster → memory per device, FLOPs, traffic,
bubble, predicted step time and MFU (the `meshtrain plan` contract of DESIGN.md).

Memory is the worst pipeline stage's: its model states (`model_states.model_state_bytes`) plus
the activations it holds at its peak. Time is built from the rates of a machine (a roofline of a
GPU preset, or a profile measured here):

    per micro-batch and stage  t_f, t_b   the block's matmuls and elementwise traffic (backward
                                          twice forward; recomputation adds its forward work),
                                          plus the tensor-parallel collectives and the p2p sends
                                          on the critical path, the context-parallel transfers
                                          the ring's attention blocks do not hide
                                          (`_context_time`), and (a measured profile) each
                                          tensor-parallel collective's wait for the slower rank
    pipeline                   m·(t_f + t_b)/(1 − bubble), the slowest stage, the bubble in the
                                          closed forms of the schedule simulator; ranks sharing
                                          cores (a CPU) run c× slower; a pipeline on a measured
                                          machine is its schedule run with each stage's own
                                          costs while busy ranks share the cores
                                          (`sharing.pipeline_time`)
    data parallel              what the backward cannot hide (`comm_overlap` of the machine)
    optimizer                  clipping and AdamW over the device's shard: measured per
                               parameter and tensor (a profile), else memory-bound
    scalars                    the gradient norm's and the loss's one-number all-reduces

No processes are started; a plan of a 405B model takes about a millisecond."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from meshtrain.ring import all_reduce_bytes
from meshtrain.parallel.options import (CP_MODES, LOW_BIT_OPTIMIZERS, SCHEDULES, Layout, expert_problem,
                                       low_bit_bytes_per_element, parse_recompute,
                                       schedule_or_batch_problem)
from meshtrain.plan import activations, block_terms, model_states, sharing, stage_activations, traffic
from meshtrain.plan.cost import hardware_flops, model_flops
from meshtrain.plan.shapes import Shape

ACCOUNTINGS = ("torch", "paper")


class PlanError(ValueError):
    """An impossible plan: the message is one line that names the fix."""


@dataclass(frozen=True)
class Workload:
    shape: Shape
    batch: int  # global, in sequences
    seq: int
    dropout: float = 0.0
    attention: str = "sdpa"
    device: str = "cuda"  # where the trainer runs: the ring's blocks are fused on "cpu", math on CUDA
    optimizer: str = "adamw"  # or a low-bit AdamW (`lowbit.py`): its state's bytes a parameter


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def check(work: Workload, lay: Layout, gpus: int | None = None) -> None:
    """Reject a layout that cannot run this workload, with one line naming the fix."""
    shape = work.shape
    for name in ("dp", "tp", "pp", "cp", "chunks", "microbatches"):
        if getattr(lay, name) < 1:
            raise PlanError(f"--{name} {getattr(lay, name)}: must be a positive integer")
    if gpus is not None and lay.world_size != gpus:
        raise PlanError(f"dp×cp×tp×pp = {lay.dp}×{lay.cp}×{lay.tp}×{lay.pp} = {lay.world_size}, not the {gpus} GPUs "
                        f"of --gpus; change --dp/--cp/--tp/--pp so that their product is {gpus}")
    if lay.zero not in (0, 1, 2, 3):
        raise PlanError(f"--zero {lay.zero}: use --zero 0, 1, 2 or 3")
    if lay.schedule not in SCHEDULES:
        raise PlanError(f"unknown schedule '{lay.schedule}'; use --schedule {' | '.join(SCHEDULES)}")
    try:
        parse_recompute(lay.recompute)
    except ValueError:
        raise PlanError(f"unknown recompute policy '{lay.recompute}'; use none | full | selective | "
                        "segments[:K]") from None
    if work.attention not in ("sdpa", "math"):
        raise PlanError(f"unknown attention '{work.attention}'; use --attention sdpa | math")
    splits = [(shape.heads, "heads"), (shape.kv_heads or shape.heads, "key/value heads"), (shape.vocab, "vocabulary")]
    if shape.kind != "moe" or shape.moe_layers < shape.layers:  # a MoE's experts stay whole over tp
        splits.insert(2, (shape.ffn_width, "MLP width" if shape.kind != "moe" else "dense MLP width"))
    for size, what in splits:
        if size % lay.tp:
            raise PlanError(f"--tp {lay.tp} does not divide the {size} {what}; use --tp {_divisors(size)}")
    if shape.kind == "moe" and shape.qk_norm == "projection" and lay.tp > 1:
        raise PlanError("the model normalises queries and keys over the whole projection (OLMoE), whose statistics "
                        "tensor parallelism would split over ranks (not built yet); use --tp 1")
    if lay.cp > 1:
        _check_context(work, lay)
    if lay.ep > 1:
        problem = expert_problem(lay, shape.experts if shape.kind == "moe" else 0, "this model")
        if problem:
            raise PlanError(problem)

    if lay.sp and lay.tp == 1:
        raise PlanError("--sp shards the sequence inside the tensor-parallel group; use --tp 2 or more with --sp")
    if lay.sp and (work.seq // lay.cp) % lay.tp:
        tokens = f"--seq-len {work.seq}" + (f" ÷ --cp {lay.cp}" if lay.cp > 1 else "")
        raise PlanError(f"--sp splits the sequence over tp: {tokens} is not divisible by --tp {lay.tp}")
    if shape.layers < lay.pp * lay.chunks:
        raise PlanError(f"the model has {shape.layers} blocks, fewer than pp×chunks = {lay.pp}×{lay.chunks}")
    problem = schedule_or_batch_problem(lay, work.batch)
    if problem:
        raise PlanError(problem)


def _check_context(work: Workload, lay: Layout) -> None:
    """What context parallelism cannot split: as `cli.validate` refuses it for a run."""
    shape = work.shape
    if lay.cp_mode not in CP_MODES:
        raise PlanError(f"unknown --cp-mode '{lay.cp_mode}'; use --cp-mode {' | '.join(CP_MODES)}")
    if work.seq % (2 * lay.cp):
        raise PlanError(f"--seq-len {work.seq} does not split into 2·cp = {2 * lay.cp} equal chunks; use a multiple "
                        f"of {2 * lay.cp}")
    if work.attention == "math" and work.dropout > 0:
        raise PlanError("--cp: attention-probability dropout (--attention math with --dropout) cannot be split over "
                        "cp; use --attention sdpa or --dropout 0")
    if lay.cp_mode == "ulysses":
        for n, what in ((shape.heads, "heads"), (shape.kv_heads or shape.heads, "key/value heads")):
            if (n // lay.tp) % lay.cp:
                raise PlanError(f"--cp-mode ulysses: the {n} {what} ({n // lay.tp} per tp rank) do not split over "
                                f"--cp {lay.cp}; use --cp-mode ring or a --cp dividing them")


# the search plans each activation peak once: ZeRO levels (and cp modes' shared terms) repeat it
_stage_activations = functools.lru_cache(maxsize=4096)(stage_activations.torch_stage_activation_bytes)


class Device:
    """The facts of one (workload, layout) that memory, traffic and time share, by stage."""

    def __init__(self, work: Workload, lay: Layout, accounting: str = "torch"):
        if accounting not in ACCOUNTINGS:
            raise PlanError(f"unknown accounting '{accounting}'; use --accounting paper | torch")
        # under context parallelism a rank holds seq/cp tokens of each sequence, and the cp
        # ranks are parameter replicas: ZeRO shards and gradients go over dp × cp
        self.work, self.layout, self.shape, self.accounting = work, lay, work.shape, accounting
        self.seq, self.replicas = work.seq // lay.cp, lay.dp * lay.cp
        self.edp = lay.dp * lay.cp * lay.tp // lay.ep  # an expert chunk's replicas (`mesh.py`)
        self.expert_zero = lay.zero if self.replicas > 1 else 0  # the trainer shards only where dp × cp does
        self.micro_batch = work.batch // (lay.dp * lay.microbatches)
        low = lay.precision == "bf16"
        self.element_bytes = 2 if (low or accounting == "paper") else 4
        self.param_bytes = self.element_bytes
        self.grad_bytes = 4 if (not low or lay.grad_dtype == "fp32") else 2
        self.recompute_mode, _ = parse_recompute(lay.recompute)
        self._where = dict(tp=lay.tp, pp=lay.pp, chunks=lay.chunks, stage_layers=lay.stage_layer_counts())
        self.fused_blocks = work.device == "cpu"  # `parallel.context.fused_blocks`
        self._held: dict[int, model_states.StageParams] = {}  # stage -> what a device of it holds

    def held(self, stage: int) -> model_states.StageParams:
        """The parameters a device of stage `stage` holds (`model_states.stage_params`)."""
        if stage not in self._held:
            self._held[stage] = model_states.stage_params(self.shape, stage=stage, **self._where)
        return self._held[stage]

    def layers_on(self, stage: int) -> tuple[int, ...]:
        """The indices of the blocks stage `stage` holds."""
        return model_states.stage_layers(self.shape, stage=stage, **self._where)

    def blocks_on(self, stage: int) -> int:
        return len(self.layers_on(stage))

    def params_on(self, stage: int) -> int:
        """The parameters a device of `stage` holds: its experts' 1/ep under expert parallelism."""
        return self.dense_params_on(stage) + (self.expert_params_on(stage) if self.layout.ep > 1 else 0)

    def stage_experts(self, stage: int) -> int:
        """All the experts' parameters of the stage's MoE layers (whole over tp)."""
        return model_states.expert_params_per_device(self.shape, stage=stage, **self._where)

    def expert_params_on(self, stage: int) -> int:
        """The experts' parameters a device of `stage` holds (1/ep of its MoE layers')."""
        return self.stage_experts(stage) // self.layout.ep

    def dense_params_on(self, stage: int) -> int:
        """What a device of `stage` holds apart from the ep-split experts (all of it at ep 1):
        reduced over dp × cp; the experts over their edp replicas."""
        held = self.held(stage)
        return held.in_blocks + held.outside - (self.stage_experts(stage) if self.layout.ep > 1 else 0)

    def recomputed_units(self, stage: int) -> list[int]:
        """Sizes of the units a stage recomputes whole (full: each block; segments[:K]: each
        chunk's run cut every K, default ⌈√run⌉, blocks), as `apply_recompute` cuts them."""
        return [size for run in model_states.stage_runs(self.shape, stage=stage, **self._where)
                for size in activations.recompute_units(run, self.layout.recompute)]

    def whole_params(self, stage: int) -> int:
        """Left whole by tp (summed over tp under SP): not the experts under ep, summed over edp."""
        return self.held(stage).whole - (self.stage_experts(stage) if self.layout.ep > 1 else 0)

    def partial_params(self, stage: int) -> int:
        return self.held(stage).partial

    def distinct_stages(self) -> list[int]:
        """One stage of each kind (first, last, and per block count between): the others are
        copies, so a plan of 64 stages costs what one of 3 does."""
        first_of = {}  # block count (a MoE's: and kinds) -> the first middle stage that holds it
        for k in range(1, self.layout.pp - 1):
            first_of.setdefault(self.stage_kind(k), k)
        return sorted({0, self.layout.pp - 1, *first_of.values()})

    def stage_kind(self, stage: int):
        """What makes a middle stage a copy of another: its block count, and for a MoE which
        of its blocks have experts."""
        if self.shape.kind != "moe" or not self.shape.dense_layers:
            return self.blocks_on(stage)
        return tuple(self.shape.is_moe(i) for i in self.layers_on(stage))

    def has_embedding(self, stage: int) -> bool:
        return stage == 0

    def has_head(self, stage: int) -> bool:
        return stage == self.layout.pp - 1

    # ---- memory ---------------------------------------------------------------------------

    def experts(self, stage: int) -> dict:
        """A MoE's figures beside the contract's: the parameters a token passes through
        (`n_active_params`), and where the experts' memory sits — the experts' parameters on
        a device of stage `stage` (whole over tp, split by pp's cut and by ZeRO/FSDP over the
        dp × cp replicas like any parameter) and their share of its model states."""
        lay = self.layout
        params = self.expert_params_on(stage)
        states = model_states.model_state_bytes(params, self.expert_zero, self.edp if lay.ep > 1 else self.replicas,
                                                precision=lay.precision,
                                                grad_dtype=lay.grad_dtype, accounting=self.accounting)
        return {"n_active_params": self.shape.active_params(), "expert_params_per_device": params,
                "expert_state_bytes": states["total"]}

    def model_states(self, stage: int) -> dict[str, float]:
        lay = self.layout
        # ZeRO-3 holds two blocks gathered at its peak, or all of them with --keep-gathered
        held = self.held(stage)
        gathered = self.params_on(stage) if lay.keep_gathered else held.outside + held.largest_pair
        kinds = dict(precision=lay.precision, grad_dtype=lay.grad_dtype, accounting=self.accounting,
                     optimizer_bytes=self.optimizer_bytes(stage))
        if lay.ep == 1:
            return model_states.model_state_bytes(self.params_on(stage), lay.zero, self.replicas,
                                                  gathered_params=gathered, **kinds)
        # the experts' chunks are sharded over their edp replicas, the rest over dp × cp; of
        # the two blocks ZeRO-3 holds gathered, each MoE layer's experts are a chunk
        if not lay.keep_gathered:
            moe_blocks = self.shape.moe_in(self.layers_on(stage))
            gathered -= min(2, moe_blocks) * self.shape.expert_params() * (lay.ep - 1) // lay.ep
        dense = model_states.model_state_bytes(self.dense_params_on(stage), lay.zero, self.replicas,
                                               gathered_params=gathered, **kinds)
        experts = model_states.model_state_bytes(self.expert_params_on(stage), self.expert_zero, self.edp, **kinds)
        return {part: dense.get(part, 0) + experts.get(part, 0) for part in dense.keys() | experts.keys()}

    def optimizer_bytes(self, stage: int) -> float:
        """The optimizer state's bytes a parameter of a device of `stage`: AdamW's 8, or a
        low-bit AdamW's, its vectors kept in fp32."""
        if self.work.optimizer not in LOW_BIT_OPTIMIZERS:
            return 8.0
        held = self.held(stage)
        params = self.params_on(stage)
        return model_states.low_bit_state_bytes(params, model_states.vector_params(self.shape, held, self.layout.tp),
                                                low_bit_bytes_per_element(self.work.optimizer))

    def _torch_terms(self) -> dict:
        sh, lay = self.shape, self.layout
        llama = (block_terms.LlamaDims(q_width=sh.q_width, kv_width=sh.kv_width, head_dim=sh.head_size,
                                       qk_norm=sh.qk_norm) if sh.kind in ("llama", "moe") else None)
        return dict(element_bytes=self.element_bytes, attention=self.work.attention, dropout=self.work.dropout,
                    ffn=sh.ffn_width, tp=lay.tp, sp=lay.sp, llama=llama,
                    cp_mode=lay.cp_mode if lay.cp > 1 else None)

    def moe_dims(self) -> block_terms.MoEDims | None:
        """A MoE model's experts as the `torch` accounting takes them (None: no experts)."""
        sh = self.shape
        if sh.kind != "moe":
            return None
        return block_terms.MoEDims(sh.experts, sh.top_k, sh.expert_ffn, shared_ffn=sh.shared_ffn,
                                   norm_topk=sh.norm_topk, aux_rows=sh.aux_rows, dense_layers=sh.dense_layers,
                                   ep=self.layout.ep,
                                   rows_share=self.layout.tp if self.layout.ep > 1 and not self.layout.sp else 1,
                                   load=self.expert_load())

    def expert_load(self) -> float:
        """The rows the worst rank's experts may receive over the balanced share: under
        expert parallelism at most ep× (every row to one rank's experts), bounded by a
        capacity factor or `--ep-max-load`; dropless and unbounded, the balanced share is
        planned (docs/planner.md: the headroom to leave)."""
        bounds = [f for f in (self.shape.capacity, self.layout.ep_max_load) if f is not None]
        return min(self.layout.ep, *bounds) if self.layout.ep > 1 and bounds else 1.0

    def activation_per_layer(self) -> float:
        """What one block keeps for backward, per micro-batch, under the layout's recompute
        mode (full and segments: its input — for segments, spread over the segment). A MoE
        model's: a MoE layer's (its repeated block; `activation_per_block` for a dense one)."""
        return self.activation_per_block(self.shape.first_moe_layer)

    def activation_per_block(self, layer: int) -> float:
        """`activation_per_layer` of block `layer`'s kind (a MoE's dense or MoE layers)."""
        s, b, sh, lay = self.seq, self.micro_batch, self.shape, self.layout
        mode = self.recompute_mode
        moe = self.moe_dims() if sh.is_moe(layer) else None
        if self.accounting == "paper":
            return activations.activation_bytes_per_layer(
                s, b, sh.hidden, sh.heads, tp=lay.tp, sp=lay.sp, recompute="full" if mode == "segments" else mode,
                attention=self.work.attention, kv_width=sh.kv_width, ffn=sh.ffn_width, swiglu=sh.kind != "gpt",
                q_width=sh.q_width if sh.kind != "gpt" else None, moe=moe)
        parts = activations.block_parts(s, b, sh.hidden, sh.heads, fused_blocks=self.fused_blocks, moe=moe,
                                        **self._torch_terms())
        blocks = self.blocks_on(0)
        return activations.recompute_kept_bytes(blocks, parts, lay.recompute) / blocks

    def activations(self, stage: int) -> float:
        """The activation peak of pipeline stage `stage`. `torch`: the step's peak as
        `stage_activations.torch_stage_activation_bytes` derives it (matched to the trainer's
        meter). `paper`: the table's bytes per layer for the blocks of the micro-batches the
        stage holds at once (`in_flight`), plus the recomputation of one block (or segment) with
        its full activations; the embedding and the head are left out, as in the paper."""
        lay, sh = self.layout, self.shape
        if self.accounting == "torch":
            return _stage_activations(
                sh.layers, self.seq, self.micro_batch, sh.hidden, sh.heads, sh.vocab, recompute=lay.recompute,
                pp=lay.pp, stage=stage, schedule=lay.schedule, microbatches=lay.microbatches, chunks=lay.chunks,
                stage_layers=tuple(lay.stage_layer_counts() or ()) or None, fused_blocks=self.fused_blocks,
                moe=self.moe_dims(), **self._torch_terms())
        held = (stage_activations.in_flight(lay.pp - stage, lay.microbatches, lay.schedule, lay.chunks)
                if lay.pp > 1 else 1)
        layers = self.layers_on(stage)
        per_block = sum(self.activation_per_block(i) for i in layers)  # each block's kind
        if self.recompute_mode == "none":
            return held * per_block
        full = max(activations.activation_bytes_per_layer(
            self.seq, self.micro_batch, sh.hidden, sh.heads, tp=lay.tp, sp=lay.sp, attention=self.work.attention,
            kv_width=sh.kv_width, ffn=sh.ffn_width, swiglu=sh.kind != "gpt", q_width=sh.q_width if sh.kind != "gpt"
            else None, moe=self.moe_dims() if sh.is_moe(i) else None) for i in layers)
        if self.recompute_mode == "segments":
            segments = self.recomputed_units(stage)
            return held * len(segments) * per_block / len(layers) + max(segments) * full
        return held * per_block + full

    # ---- time -------------------------------------------------------------------------------

    def attention_core_time(self, machine) -> float:
        """One block's attention scores and weighted sum, forward, per micro-batch: under cp a
        rank's queries (s = seq/cp of them) meet all seq keys, cp blocks of s × s."""
        heads = self.shape.heads // self.layout.tp
        s, dtype = self.seq, self.layout.precision
        return 2 * machine.matmul_time(s, self.shape.head_size, s, dtype, batch=self.micro_batch * heads) * self.layout.cp

    def micro_batch_times(self, machine, stage: int) -> tuple[float, float]:
        """(forward, backward) seconds of one micro-batch on stage `stage`, compute only."""
        sh, lay, b, s, t = self.shape, self.layout, self.micro_batch, self.seq, self.layout.tp
        dtype, h = lay.precision, sh.hidden
        rows = b * s
        core = self.attention_core_time(machine)
        kinds = {}  # a block's forward time by kind (dense, MoE)
        fwd = bwd = 0.0
        for layer in self.layers_on(stage):
            moe = sh.is_moe(layer)
            if moe not in kinds:
                linear = sum(machine.matmul_time(m, k, n, dtype) for m, k, n in self._matrices(moe))
                if moe:  # the experts' grouped products: E groups of the k·n rows, balanced
                    n = rows // (t if lay.sp else 1)
                    r = max(1, sh.top_k * n // sh.experts)
                    linear += sum(machine.matmul_time(r, k, m, dtype, batch=sh.experts)
                                  for k, m in ((h, 2 * sh.expert_ffn), (sh.expert_ffn, h)))
                traffic_bytes = 2 * activations.torch_activation_bytes_per_layer(
                    s, b, h, sh.heads, moe=self.moe_dims() if moe else None, **self._torch_terms())
                elementwise = machine.elementwise_time(traffic_bytes)
                ops = (OPS_PER_BLOCK + (OPS_PER_MOE if moe else 0)) * machine.op_overhead_s
                block_f = linear + core + elementwise + ops
                recompute = {"none": 0.0, "selective": core + elementwise / 2 + ops / 2}.get(self.recompute_mode,
                                                                                             block_f)
                kinds[moe] = (block_f, 2 * block_f + recompute)
            fwd, bwd = fwd + kinds[moe][0], bwd + kinds[moe][1]
        if self.has_head(stage):
            head = machine.matmul_time(rows, h, sh.vocab // t, dtype)
            loss = machine.elementwise_time(2 * 3 * rows * sh.vocab // t * 4) + OPS_OUTSIDE * machine.op_overhead_s
            fwd, bwd = fwd + head + loss, bwd + 2 * head + loss
        if self.has_embedding(stage):
            fwd += machine.elementwise_time(2 * rows * h * self.element_bytes) + OPS_OUTSIDE * machine.op_overhead_s
        return fwd, bwd

    def _matrices(self, moe: bool) -> list[tuple[int, int, int]]:
        """The (m, k, n) of a block's linear layers on one rank: the attention's split by tp;
        a dense MLP's split by tp (a GPT's two, SwiGLU's three); a MoE layer's router and
        shared expert whole, on the rank's tokens (its share under SP), its experts apart."""
        sh, t = self.shape, self.layout.tp
        rows, h, f, kv, q = self.micro_batch * self.seq, sh.hidden, sh.ffn_width, sh.kv_width, sh.q_width
        matrices = [(rows, h, (q + 2 * kv) // t), (rows, q // t, h)]
        if moe:
            n = rows // (t if self.layout.sp else 1)
            shared = [(n, h, 2 * sh.shared_ffn), (n, sh.shared_ffn, h)] if sh.shared_ffn else []
            return matrices + [(n, h, sh.experts)] + shared
        if sh.kind == "gpt":
            return matrices + [(rows, h, f // t), (rows, f // t, h)]
        return matrices + [(rows, h, 2 * f // t), (rows, f // t, h)]


# Zero-bubble's input pass's share of a split stage's backward, B ÷ (B + W), as `train
# --trace` measures it (`benchmarks/zero_bubble.sh`: gpt-small, pp 2, m 4, the last stage's
# median input and weight passes, 55.6 and 38.9 ms in one run, 136.5 and 98.9 under load in
# another: 0.59 and 0.58): the input pass runs every non-linear operator's backward and the
# linear layers' δ·W, the weight pass only their δᵀ·x.
ZB_INPUT_SHARE = 0.59


def zero_bubble_split(stage: int, forward: float, backward: float) -> tuple[float, float, float]:
    """(forward, input pass, weight pass) of a zero-bubble stage: the first stage has no input
    gradient to send and runs each backward whole in its weight pass (`engine.py`); the
    others split it by the measured share."""
    share = 0.0 if stage == 0 else ZB_INPUT_SHARE
    return forward, backward * share, backward * (1 - share)


OPS_PER_BLOCK = 30  # eager operators of one block's forward (its backward: twice as many nodes)
OPS_PER_MOE = 30  # a MoE layer's more: routing, sorting, gathering, weighting, summing back, its balancing loss
OPS_OUTSIDE = 10  # the embedding's, or the head's and the loss's


def bubble_fraction(schedule: str, pp: int, microbatches: int, chunks: int = 1) -> float:
    """Idle fraction of the schedule's timeline (forward 1, backward 2, or 1 + 1 when split),
    in the closed forms the simulator reproduces exactly (a test holds them equal):
    (p−1)/(m+p−1) for GPipe and 1F1B, (p−1)/(v·m+p−1) interleaved with v chunks, and
    (p−1)/(3m+p−1) for the zero-bubble schedule, whose weight gradients fill the drain."""
    if pp == 1:
        return 0.0
    p, m = pp, microbatches
    if schedule == "interleaved":
        return (p - 1) / (chunks * m + p - 1)
    if schedule == "zb":
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (m + p - 1)


def _transfer_time(machine, xs: list[traffic.Transfer], across_nodes: bool) -> float:
    return sum(x.calls * machine.collective_time(x.kind, x.nbytes, across_nodes) for x in xs)


def _skew_time(machine, tp: list[traffic.Transfer], compute: float, microbatches: int) -> float:
    """Per micro-batch, what tensor parallelism's collectives wait for the slower rank: each
    is synchronous, issued after an equal share of the micro-batch's compute (a machine
    without a `skew_time`, a GPU's roofline, waits nothing)."""
    calls = sum(x.calls for x in tp) / microbatches
    skew = getattr(machine, "skew_time", None)
    return calls * skew(compute / calls) if calls and skew else 0.0


def _kind(d: Device, stage: int) -> int:
    """The stage among `d.distinct_stages()` that stage `stage` is a copy of."""
    if stage in (0, d.layout.pp - 1):
        return stage
    return next(k for k in d.distinct_stages() if 0 < k < d.layout.pp - 1 and d.stage_kind(k) == d.stage_kind(stage))


def _shared_pipeline(d: Device, lay: Layout, times: dict, per_micro: dict, cores: float):
    """(makespan, busy time per stage) of the schedule on `cores` shared by all ranks, each
    stage's micro-batch costing its own compute plus its transfers (spread over forward and
    backward as the compute is)."""
    costs = []
    for stage in range(lay.pp):
        k = _kind(d, stage)
        scale = per_micro[k] / sum(times[k])
        forward, backward = times[k][0] * scale, times[k][1] * scale
        costs.append((forward, backward) if lay.schedule != "zb" else zero_bubble_split(stage, forward, backward))
    return sharing.pipeline_time(lay.schedule, lay.microbatches, lay.chunks, tuple(costs), lay.dp * lay.tp, cores)


def _context_time(machine, d: Device, stage: int, cp: list[traffic.Transfer], across_nodes: bool) -> float:
    """Per micro-batch, what context parallelism's transfers add to a stage's critical path.
    The ring issues each hop before the block it overlaps: of its cp block steps per pass,
    cp − 1 have a transfer in flight, so it hides up to (cp − 1)/cp of the attention core
    (forward, backward at twice that, and a recomputed forward), as much as the machine
    overlaps communication (`comm_overlap`: a GPU's streams, none on a CPU profile). The
    all-to-alls of ulysses wait for their data: all exposed."""
    lay = d.layout
    sent = _transfer_time(machine, cp, across_nodes) / lay.microbatches
    if lay.cp_mode != "ring" or not sent:
        return sent
    passes = 3 + (lay.recompute != "none")
    window = d.blocks_on(stage) * passes * d.attention_core_time(machine) * (lay.cp - 1) / lay.cp
    return sent - min(sent, machine.comm_overlap * window)


def _scalar_time(machine, lay: Layout, across: dict[str, bool]) -> float:
    """The one-number all-reduces every step makes, each a collective's latency: the
    gradient norm's partial sums over each axis (`optim.clip_grad_norm_`) and the loss over
    pp and dp (`train_step`), on the axes of more than one rank."""
    sizes = {"dp": lay.dp * lay.cp, "tp": lay.tp, "pp": lay.pp}  # dp: the parameters' replicas
    calls = [axis for axis in ("dp", "tp", "pp", "pp", "dp") if sizes[axis] > 1]
    return sum(machine.collective_time("all_reduce", all_reduce_bytes(4, sizes[axis]), across[axis])
               for axis in calls)


def _optimizer_time(machine, d: Device, stage: int, states: dict) -> float:
    """The step after backward (clipping, AdamW) over the stage's shard: as the machine
    profile measured it per parameter and per tensor when it did; else memory-bound, every
    state read and written, plus a few dispatches."""
    lay = d.layout
    params = d.params_on(stage) / (d.replicas if lay.zero >= 1 else 1)
    layers = d.layers_on(stage)
    tensors = sum(d.shape.layer_tensors(i) for i in layers) + d.shape.outside_tensors(
        d.has_embedding(stage), d.has_head(stage))
    measured = getattr(machine, "optimizer_time", lambda *_: None)(params, tensors)  # a profile's, if it has one
    if measured is not None:
        return measured
    shard = states["total"] - states.get("gathered", 0)
    return machine.elementwise_time(2 * shard) + 20 * machine.op_overhead_s


def _crosses_nodes(lay: Layout, gpus_per_node: int) -> dict[str, bool]:
    """Whether each axis's groups span nodes: ranks are tp-major (tp innermost, then cp, dp, pp)."""
    inner = lay.tp * lay.cp
    return {"tp": lay.tp > gpus_per_node, "cp": lay.cp > 1 and inner > gpus_per_node,
            "ep": lay.ep > gpus_per_node, "edp": lay.dp * inner > gpus_per_node,
            "dp": inner * lay.dp > gpus_per_node and lay.dp * lay.cp > 1,
            "pp": lay.pp > 1 and inner * lay.dp * lay.pp > gpus_per_node}


def plan(work: Workload, lay: Layout, machine, *, memory_bytes: float | None = None,
         gpus_per_node: int = 8, peak_flops: float | None = None, accounting: str = "torch",
         time_unfit: bool = True) -> dict | None:
    """The plan of one layout (checked first), in the keys of the contract plus breakdowns;
    None when it does not fit `memory_bytes` and `time_unfit` is off (the search's shortcut)."""
    check(work, lay)
    d = Device(work, lay, accounting)
    stages = d.distinct_stages()
    states = {k: d.model_states(k) for k in stages}
    acts = {k: d.activations(k) for k in stages}
    totals = {k: states[k]["total"] + acts[k] for k in stages}
    worst = max(stages, key=totals.get)
    if not time_unfit and memory_bytes is not None and totals[worst] > memory_bytes:
        return None
    across = _crosses_nodes(lay, gpus_per_node)

    m = lay.microbatches
    times = {k: d.micro_batch_times(machine, k) for k in stages}
    moves = {k: traffic.transfers(d, k) for k in stages}
    context = {k: _context_time(machine, d, k, moves[k]["cp"], across["cp"]) for k in stages}
    per_micro = {k: sum(times[k]) + _skew_time(machine, moves[k]["tp"], sum(times[k]), m) + context[k]
                 + sum(_transfer_time(machine, moves[k][axis], across[axis]) for axis in ("tp", "pp", "ep")) / m
                 for k in stages}
    bubble = bubble_fraction(lay.schedule, lay.pp, m, lay.chunks)
    slowest = max(stages, key=per_micro.get)
    # Ranks that share cores (a CPU running more ranks than it has cores) are that much slower
    # each, but take up each other's idle time: the pipeline's bubble is free up to that point.
    shared = getattr(machine, "shared_cores", 1.0)
    cores = getattr(machine, "cores", None)
    if lay.pp > 1 and cores is not None:  # a measured machine: the schedule run with each stage's costs
        pipeline, busy = _shared_pipeline(d, lay, times, per_micro, cores)
        busiest = max(range(lay.pp), key=busy.__getitem__)
        slowest = _kind(d, busiest)
        compute = busy[busiest] * sum(times[slowest]) / per_micro[slowest]
        moving = busy[busiest] - compute
        context_exposed = busy[busiest] * context[slowest] / per_micro[slowest]
    else:
        compute = m * sum(times[slowest]) * shared
        pipeline = m * per_micro[slowest] * max(1 / (1 - bubble), shared)
        moving = m * (per_micro[slowest] - sum(times[slowest])) * shared
        context_exposed = m * context[slowest] * shared
    dp_time = sum(_transfer_time(machine, moves[slowest].get(axis, []), across[axis]) for axis in ("dp", "edp")) * shared
    window = times[slowest][1] if lay.zero < 2 else compute  # what the reductions can hide under
    hidden = min(dp_time, machine.comm_overlap * window)
    optimizer = _optimizer_time(machine, d, slowest, states[slowest]) * shared
    scalars = _scalar_time(machine, lay, across) * shared
    step = pipeline + dp_time - hidden + optimizer + scalars

    flops = model_flops(d.shape, work.batch, work.seq)
    return {
        "n_params": d.shape.n_params(),
        "model_state_bytes": states[worst],
        "activation_bytes": acts[0],
        "activation_bytes_per_layer": d.activation_per_layer(),
        "total_bytes": totals[worst],
        "fits": None if memory_bytes is None else totals[worst] <= memory_bytes,
        "flops_per_step": flops,
        "hardware_flops_per_step": hardware_flops(d.shape, work.batch, work.seq, lay.recompute),
        "bubble_fraction": bubble,
        "comm_bytes_per_step": traffic.bytes_per_axis(moves[0]),
        "predicted_step_time_s": step,
        "mfu": flops / (step * lay.world_size * peak_flops) if peak_flops else None,
        "micro_batch_size": d.micro_batch,
        "worst_stage": worst,
        **(d.experts(worst) if d.shape.kind == "moe" else {}),
        "time_s": {"compute": compute, "tp_pp": moving - context_exposed, "cp_exposed": context_exposed,
                   "bubble": pipeline - compute - moving,
                   "dp_exposed": dp_time - hidden, "optimizer": optimizer, "scalars": scalars},
    }

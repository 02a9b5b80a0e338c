"""Pipeline schedules as data. A schedule is a pure function
`(stages, microbatches, chunks) -> one list of instructions per stage`; the simulator runs
those lists with costs (timeline, bubble, memory, deadlock check), the executor runs the
same lists with real point-to-point transfers, and the visualiser draws the simulator's
timeline. Nothing about a schedule is written twice.

Stage s holds model chunks 0..v-1; chunk c of stage s is virtual stage c·p + s, so with
interleaving a micro-batch goes round the stages v times. Generators only order the
compute; `with_communication` adds the transfers every order implies: a forward receives
its input from the previous virtual stage and sends its output to the next; a backward
receives its output's gradient from the next and sends its input's gradient back.

Transfers come in groups (`Transfers`), issued together as one `batch_isend_irecv`: on NCCL a
send blocks until its receive runs, tags are ignored and a rank has one ordered stream, so a
stage that posts "send activation" alone while its neighbour posts "send gradient" alone
waits for ever. Each group holds the previous compute step's sends and the next one's
receives (Megatron's `send_forward_recv_backward`); a compute step is one instruction, or in
the steady state of the interleaved schedule a forward and a backward together, so that its
group is Megatron's `send_forward_backward_recv_forward_backward` — grouping per instruction
jams interleaved at p = 2 (m ≥ 4), 3 and 4. The simulator proves every schedule under those
rules."""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")


@dataclass(frozen=True)
class Instruction:
    mb: int = 0
    chunk: int = 0


class Forward(Instruction):
    """Forward of micro-batch `mb` through this stage's chunk `chunk`."""


class Backward(Instruction):
    """Backward: the gradients of the chunk's input and of its weights."""


class BackwardInput(Instruction):
    """Zero-bubble: only the input's gradient (what the previous stage waits for)."""


class BackwardWeight(Instruction):
    """Zero-bubble: only the weights' gradients, deferred to fill the bubble."""


class SendActivation(Instruction):
    pass


class RecvActivation(Instruction):
    pass


class SendGrad(Instruction):
    pass


class RecvGrad(Instruction):
    pass


TRANSFER = (SendActivation, RecvActivation, SendGrad, RecvGrad)
SEND = (SendActivation, SendGrad)


@dataclass(frozen=True)
class Transfers:
    """Sends and receives issued together and completed together (one batch_isend_irecv)."""
    ops: tuple[Instruction, ...]


class SyncGrads(Instruction):
    """All micro-batches done: synchronise gradients (data parallelism) before the step."""


class OptimizerStep(Instruction):
    pass


COMPUTE = (Forward, Backward, BackwardInput, BackwardWeight)
INPUT_GRADIENT = (Backward, BackwardInput)  # what sends a gradient back


def split_layers(n_layers: int, parts: int, stage_layers: list[int] | None = None) -> list[range]:
    """Block indices of each virtual stage: as even as possible, the larger parts first, or
    the sizes given (the planner cuts its stages with this too)."""
    sizes = stage_layers or [n_layers // parts + (1 if i < n_layers % parts else 0) for i in range(parts)]
    if len(sizes) != parts or sum(sizes) != n_layers or min(sizes) < 1:
        raise ValueError(f"stage layers {sizes} must be {parts} positive sizes summing to {n_layers}")
    starts = [sum(sizes[:i]) for i in range(parts)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


def virtual_stage(stage: int, chunk: int, stages: int) -> int:
    return chunk * stages + stage


def flat(ops: list) -> list[Instruction]:
    """A list with its groups of transfers spelled out one by one."""
    return [t for op in ops for t in (op.ops if isinstance(op, Transfers) else (op,))]


def transfers_of(stage: int, op: Instruction, stages: int, chunks: int) -> tuple[list, list]:
    """(the receives before `op`, the sends after it)."""
    vs, last = virtual_stage(stage, op.chunk, stages), stages * chunks - 1
    if isinstance(op, Forward):
        return ([RecvActivation(op.mb, op.chunk)] if vs > 0 else []), ([SendActivation(op.mb, op.chunk)] if vs < last else [])
    if isinstance(op, INPUT_GRADIENT):
        return ([RecvGrad(op.mb, op.chunk)] if vs < last else []), ([SendGrad(op.mb, op.chunk)] if vs > 0 else [])
    return [], []


def with_communication(stage: int, steps: list, stages: int, chunks: int) -> list:
    """One stage's compute `steps` (instructions, or tuples of instructions run back to back)
    with the transfers they imply, in groups: before each step, the previous step's sends
    and this step's receives; after the last, its sends. Then sync and step."""
    out: list = []
    pending: list[Instruction] = []
    for step in steps:
        step = step if isinstance(step, tuple) else (step,)
        moves = [transfers_of(stage, op, stages, chunks) for op in step]
        group = pending + [r for receives, _ in moves for r in receives]
        out += ([Transfers(tuple(group))] if group else []) + list(step)
        pending = [t for _, sends in moves for t in sends]
    out += [Transfers(tuple(pending))] if pending else []
    return out + [SyncGrads(), OptimizerStep()]


def gpipe_order(stage: int, stages: int, microbatches: int) -> list[Instruction]:
    """GPipe: every forward, then every backward (in reverse, as activations were stacked)."""
    return [Forward(mb) for mb in range(microbatches)] + [Backward(mb) for mb in reversed(range(microbatches))]


def one_f_one_b_order(stage: int, stages: int, microbatches: int, split: bool = False) -> list[Instruction]:
    """PipeDream-flush (1F1B): a warm-up of p−s−1 forwards, then one forward and one backward
    in turn, then the remaining backwards. At most min(p−s, m) micro-batches in flight."""
    warmup = min(stages - stage - 1, microbatches)
    order: list[Instruction] = [Forward(mb) for mb in range(warmup)]
    back = BackwardInput if split else Backward
    for k in range(microbatches - warmup):
        order += [Forward(warmup + k), back(k)]
    order += [back(mb) for mb in range(microbatches - warmup, microbatches)]
    return order


def zero_bubble_order(stage: int, stages: int, microbatches: int) -> list[Instruction]:
    """ZB-H1 (Qi et al., 2023): 1F1B with each backward split in two. The input-gradient half
    keeps 1F1B's place — it is what the previous stage waits for, so the backward chain
    through the pipeline gets shorter — and stage s defers each weight-gradient half by s
    micro-batches, so its last s of them fill the cool-down where 1F1B's stage would wait.
    With forward, input and weight gradient each costing 1, the bubble is (p−1)·(F + B − W)
    instead of 1F1B's (p−1)·(F + B + W), and each stage holds at most p micro-batches (until
    their weight gradient): 1F1B's peak, reached on every stage."""
    order = one_f_one_b_order(stage, stages, microbatches, split=True)
    out: list[Instruction] = []
    done = 0  # weight gradients placed
    for op in order:
        out.append(op)
        if isinstance(op, BackwardInput) and op.mb - done >= stage:
            out.append(BackwardWeight(done))
            done += 1
    return out + [BackwardWeight(mb) for mb in range(done, microbatches)]


def interleaved_steps(stage: int, stages: int, microbatches: int, chunks: int) -> list:
    """Megatron's interleaved 1F1B: each stage holds `chunks` model chunks; micro-batches go
    through them in groups of p. Forward k of this stage is micro-batch (k // pv)·p + k % p in
    chunk (k // p) % v; backwards take the chunks in reverse. A warm-up of
    (p − s − 1)·2 + (v − 1)·p forwards, then one forward and one backward in turn — each pair
    one step, with no transfer between them — then the remaining backwards."""
    p, v, m = stages, chunks, microbatches
    total = m * v

    def forward(k: int) -> Forward:
        return Forward((k // (p * v)) * p + k % p, (k // p) % v)

    def backward(k: int) -> Backward:
        return Backward((k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    warmup = min((p - stage - 1) * 2 + (v - 1) * p, total)
    steps: list = [forward(k) for k in range(warmup)]
    steps += [(forward(warmup + k), backward(k)) for k in range(total - warmup)]
    return steps + [backward(k) for k in range(total - warmup, total)]


def interleaved_order(stage: int, stages: int, microbatches: int, chunks: int) -> list[Instruction]:
    return [op for step in interleaved_steps(stage, stages, microbatches, chunks)
            for op in (step if isinstance(step, tuple) else (step,))]


def compute_steps(name: str, stage: int, stages: int, microbatches: int, chunks: int = 1) -> list:
    """One stage's compute for schedule `name`, as steps: an instruction, or a tuple of
    instructions that run back to back with no transfer between them."""
    if name == "interleaved" and chunks > 1:
        _check_shape(name, stages, microbatches, chunks)
        return interleaved_steps(stage, stages, microbatches, chunks)
    return compute_order(name, stage, stages, microbatches, chunks)


def _check_shape(name: str, stages: int, microbatches: int, chunks: int) -> None:
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule '{name}'; use {' | '.join(SCHEDULES)}")
    if name == "interleaved" and microbatches % stages:
        raise ValueError(f"interleaved needs micro-batches in groups of the {stages} stages; "
                         f"use --microbatches a multiple of {stages}")
    if name != "interleaved" and chunks != 1:
        raise ValueError(f"{name} runs one model chunk per stage; use --chunks 1 (or --schedule interleaved)")


def compute_order(name: str, stage: int, stages: int, microbatches: int, chunks: int = 1) -> list[Instruction]:
    """One stage's compute instructions (no transfers) for schedule `name`."""
    _check_shape(name, stages, microbatches, chunks)
    if name == "interleaved":
        return interleaved_order(stage, stages, microbatches, chunks)
    build = {"gpipe": gpipe_order, "1f1b": one_f_one_b_order, "zb": zero_bubble_order}[name]
    return build(stage, stages, microbatches)


def schedule(name: str, stages: int, microbatches: int, chunks: int = 1) -> list[list]:
    """Every stage's instruction list for schedule `name` (transfers in `Transfers` groups)."""
    steps = [compute_steps(name, s, stages, microbatches, chunks) for s in range(stages)]
    return [with_communication(s, order, stages, chunks) for s, order in enumerate(steps)]

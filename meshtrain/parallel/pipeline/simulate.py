"""Run a schedule's instruction lists with costs, with no processes: the timeline, the
makespan, the bubble fraction, each stage's peak of micro-batches in flight, and the proof
that it can run under NCCL's rules — the strictest transport the executor meets:

- each stage has one ordered queue of transfers (NCCL's stream for all its peers): it issues
  its groups of transfers (`Transfers`; a lone transfer is a group of one) in list order, and
  a group becomes current when the one before it has completed. Computing goes on while a
  group of sends waits in the queue; a group with a receive is waited for (the next
  instruction needs its data), and the step ends when the queue is empty;
- a send completes only together with its receive (both groups current at once), whatever
  its size; a group completes as a whole, when all of its transfers have;
- tags are ignored: between two stages, the k-th message one sends is the k-th the other
  receives from it, whatever its kind, so those must be the same message.

No stage may wait for ever, and every (micro-batch, chunk) goes forward and back exactly
once, each backward after its forward. The executor runs the same lists; `meshtrain
schedule` draws this."""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

from meshtrain.parallel.pipeline.schedules import (COMPUTE, SEND, TRANSFER, Backward, BackwardInput,
                                                   BackwardWeight, Forward, Instruction, RecvActivation, RecvGrad,
                                                   SendActivation, SendGrad, Transfers, virtual_stage)


class ScheduleError(ValueError):
    """A schedule that cannot run as written (deadlock, unmatched transfer, missing work)."""


@dataclass(frozen=True)
class Costs:
    """Time of each instruction for one whole stage; a chunk of an interleaved stage takes
    1/chunks of it. Defaults: forward 1, backward 2 (1 + 1 when split), transfers 0."""
    forward: Fraction = Fraction(1)
    backward_input: Fraction = Fraction(1)
    backward_weight: Fraction = Fraction(1)
    transfer: Fraction = Fraction(0)

    def of(self, op: Instruction, chunks: int, stage: int = 0):
        if isinstance(op, Forward):
            t = self.forward
        elif isinstance(op, Backward):
            t = self.backward_input + self.backward_weight
        elif isinstance(op, BackwardInput):
            t = self.backward_input
        elif isinstance(op, BackwardWeight):
            t = self.backward_weight
        else:
            return 0
        return t / chunks


@dataclass
class Span:
    stage: int
    start: object
    end: object
    op: Instruction

    @property
    def kind(self) -> str:
        return {Forward: "F", Backward: "B", BackwardInput: "B", BackwardWeight: "W"}[type(self.op)]


@dataclass
class Simulation:
    stages: int
    chunks: int
    spans: list[Span]
    makespan: object
    busy: list
    peak_inflight: list[int]
    order: list[list[Instruction]] = field(repr=False, default_factory=list)

    @property
    def bubble_fraction(self):
        """Idle time over total stage-time: (p·makespan − Σ busy) / (p·makespan)."""
        total = self.stages * self.makespan
        return (total - sum(self.busy)) / total if total else 0


def message_key(stage: int, op: Instruction, stages: int) -> tuple:
    """The key a transfer is matched by: kind, micro-batch, the receiving virtual stage."""
    vs = virtual_stage(stage, op.chunk, stages)
    if isinstance(op, SendActivation):
        return ("activation", op.mb, vs + 1)
    if isinstance(op, RecvActivation):
        return ("activation", op.mb, vs)
    if isinstance(op, SendGrad):
        return ("gradient", op.mb, vs - 1)
    return ("gradient", op.mb, vs)


def peer_of(stage: int, op: Instruction, stages: int) -> int:
    """The stage at the other end of a transfer."""
    step = +1 if isinstance(op, (SendActivation, RecvGrad)) else -1
    return (virtual_stage(stage, op.chunk, stages) + step) % stages


def grouped(ops: list) -> list:
    """A stage's list with every lone transfer as a group of one (how it would be issued)."""
    return [Transfers((op,)) if isinstance(op, TRANSFER) else op for op in ops]


def match_transfers(lists: list[list]) -> dict[tuple, tuple]:
    """Pair every transfer (stage, item, position in its group) with its other end, by order
    alone per (sender, receiver), as NCCL does; a pair whose messages differ, or a message
    with no other end, is a `ScheduleError`."""
    p = len(lists)
    sends: dict[tuple, list] = {}
    receives: dict[tuple, list] = {}
    for s, items in enumerate(lists):
        for i, item in enumerate(items):
            for j, op in enumerate(item.ops if isinstance(item, Transfers) else ()):
                q = peer_of(s, op, p)
                into = sends.setdefault((s, q), []) if isinstance(op, SEND) else receives.setdefault((q, s), [])
                into.append(((s, i, j), message_key(s, op, p), op))
    match = {}
    for pair in sorted(set(sends) | set(receives)):
        out, into = sends.get(pair, []), receives.get(pair, [])
        for k, ((a, key_a, op_a), (b, key_b, op_b)) in enumerate(zip(out, into)):
            if key_a != key_b:
                raise ScheduleError(f"stage {pair[0]}'s message {k} to stage {pair[1]} is {op_a} but stage {pair[1]} "
                                    f"takes it as {op_b}: NCCL matches by order, not by tag")
            match[a], match[b] = b, a
        if len(out) != len(into):
            extra = (out if len(out) > len(into) else into)[len(into) if len(out) > len(into) else len(out)]
            what = "sent but never received" if len(out) > len(into) else "received but never sent"
            raise ScheduleError(f"{what}: {extra[2]} between stages {pair[0]} and {pair[1]}")
    return match


def simulate(lists: list[list], chunks: int = 1, costs=Costs(), microbatches: int | None = None) -> Simulation:
    """Execute every stage's list in order under NCCL's rules (module docstring). `costs` is
    a `Costs` or anything with its `of(op, chunks, stage)` and `transfer` (measured ones)."""
    p = len(lists)
    items = [grouped(ops) for ops in lists]
    match = match_transfers(items)
    clock = [0] * p  # the compute stream's time
    at = [0] * p  # the next item each stage computes or issues
    queue: list[list[int]] = [[] for _ in range(p)]  # issued groups (item indices), the current one first
    issued: list[dict] = [{} for _ in range(p)]  # group -> when it was issued
    current_since = [0] * p  # when the queue's head became current
    completed: list[dict] = [{} for _ in range(p)]  # group -> when it completed
    done: dict[tuple, object] = {}  # transfer -> when it completed
    spans: list[Span] = []

    def is_current(end: tuple) -> bool:
        return bool(queue[end[0]]) and queue[end[0]][0] == end[1]

    def pump(s: int) -> bool:
        """Complete what the current group can; True when something moved."""
        if not queue[s]:
            return False
        i, moved = queue[s][0], False
        for j in range(len(items[s][i].ops)):
            other = match[(s, i, j)]
            if (s, i, j) not in done and is_current(other):
                done[(s, i, j)] = done[other] = max(current_since[s], current_since[other[0]]) + costs.transfer
                moved = True
        ends = [done.get((s, i, j)) for j in range(len(items[s][i].ops))]
        if all(end is not None for end in ends):
            completed[s][i] = max(ends)
            queue[s].pop(0)
            if queue[s]:
                current_since[s] = max(completed[s][i], issued[s][queue[s][0]])
            moved = True
        return moved

    def compute(s: int) -> bool:
        """Run or issue the stage's next item; True when something moved."""
        if at[s] >= len(items[s]):
            return False
        item = items[s][at[s]]
        if isinstance(item, Transfers):
            if at[s] not in issued[s]:
                issued[s][at[s]] = clock[s]
                queue[s].append(at[s])
                if len(queue[s]) == 1:
                    current_since[s] = clock[s]
                if not any(isinstance(op, (RecvActivation, RecvGrad)) for op in item.ops):
                    at[s] += 1  # sends only: computing goes on
                return True
            if at[s] not in completed[s]:
                return False  # waits for the data it receives
            clock[s] = max(clock[s], completed[s][at[s]])
        elif isinstance(item, COMPUTE):
            cost = costs.of(item, chunks, s)
            spans.append(Span(s, clock[s], clock[s] + cost, item))
            clock[s] += cost
        at[s] += 1
        return True

    while any(at[s] < len(items[s]) or queue[s] for s in range(p)):
        progressed = False
        for s in range(p):
            while pump(s) | compute(s):
                progressed = True
        if not progressed:
            waiting = {s: items[s][queue[s][0] if queue[s] else at[s]] for s in range(p)
                       if at[s] < len(items[s]) or queue[s]}
            raise ScheduleError(f"deadlock: stages wait forever at {waiting}")
    _check_work(lists, chunks, microbatches)
    ends = [max([clock[s], *completed[s].values()]) for s in range(p)]
    busy = [sum((sp.end - sp.start for sp in spans if sp.stage == s), 0) for s in range(p)]
    return Simulation(p, chunks, spans, max(ends) if ends else 0, busy, _peak_inflight(lists), lists)


def _check_work(lists: list[list], chunks: int, microbatches: int | None) -> None:
    """Each (micro-batch, chunk) forward once and back once (input and weight gradients once
    each when split), every backward after its forward on its stage."""
    for s, ops in enumerate(lists):
        seen: dict[tuple, list[str]] = {}
        for op in ops:
            if isinstance(op, COMPUTE):
                seen.setdefault((op.mb, op.chunk), []).append(type(op).__name__)
        expected_keys = {(mb, c) for mb in range(microbatches) for c in range(chunks)} if microbatches else None
        if expected_keys is not None and set(seen) != expected_keys:
            raise ScheduleError(f"stage {s} runs {sorted(set(seen) ^ expected_keys)[:4]} wrongly")
        for key, kinds in seen.items():
            if kinds not in (["Forward", "Backward"], ["Forward", "BackwardInput", "BackwardWeight"]):
                raise ScheduleError(f"stage {s}, (micro-batch, chunk) {key}: {kinds}, not forward then backward once")


def _peak_inflight(lists: list[list]) -> list[int]:
    """Per stage, the most (micro-batch, chunk) activations held at once: from a forward until
    the backward that frees them (the weight gradient's, when split)."""
    peaks = []
    for ops in lists:
        held, peak = 0, 0
        for op in ops:
            if isinstance(op, Forward):
                held += 1
                peak = max(peak, held)
            elif isinstance(op, (Backward, BackwardWeight)):
                held -= 1
        peaks.append(peak)
    return peaks

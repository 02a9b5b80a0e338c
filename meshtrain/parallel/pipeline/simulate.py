"""Run a schedule's instruction lists with costs, with no processes: the timeline, the
makespan, the bubble fraction, each stage's peak of micro-batches in flight, and the proof
that it can run — every receive finds its send (sends do not wait, receives do), no stage
waits forever, every (micro-batch, chunk) goes forward and back exactly once, each backward
after its forward. The executor runs the same lists; `meshtrain schedule` draws this."""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

from meshtrain.parallel.pipeline.schedules import (COMPUTE, Backward, BackwardInput, BackwardWeight, Forward,
                                                   Instruction, RecvActivation, RecvGrad, SendActivation,
                                                   SendGrad, virtual_stage)


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


def simulate(lists: list[list[Instruction]], chunks: int = 1, costs=Costs(),
             microbatches: int | None = None) -> Simulation:
    """Execute every stage's list in order; a receive waits for its send's arrival. `costs`
    is a `Costs` or anything with its `of(op, chunks, stage)` and `transfer` (measured ones)."""
    p = len(lists)
    clock = [0] * p
    at = [0] * p  # next instruction of each stage
    sent: dict[tuple, object] = {}  # message -> arrival time
    spans: list[Span] = []
    while any(at[s] < len(lists[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while at[s] < len(lists[s]):
                op = lists[s][at[s]]
                if isinstance(op, (SendActivation, SendGrad)):
                    key = message_key(s, op, p)
                    if key in sent:
                        raise ScheduleError(f"stage {s} sends {key} twice")
                    sent[key] = clock[s] + costs.transfer
                elif isinstance(op, (RecvActivation, RecvGrad)):
                    key = message_key(s, op, p)
                    if key not in sent:
                        break  # blocked until the send happens
                    clock[s] = max(clock[s], sent.pop(key))
                elif isinstance(op, COMPUTE):
                    cost = costs.of(op, chunks, s)
                    spans.append(Span(s, clock[s], clock[s] + cost, op))
                    clock[s] += cost
                at[s] += 1
                progressed = True
        if not progressed:
            waiting = {s: lists[s][at[s]] for s in range(p) if at[s] < len(lists[s])}
            raise ScheduleError(f"deadlock: stages wait forever at {waiting}")
    if sent:
        raise ScheduleError(f"sent but never received: {sorted(sent)[:5]}")
    _check_work(lists, chunks, microbatches)
    _check_fifo(lists)
    busy = [sum((sp.end - sp.start for sp in spans if sp.stage == s), 0) for s in range(p)]
    return Simulation(p, chunks, spans, max(clock) if clock else 0, busy, _peak_inflight(lists), lists)


def _check_work(lists: list[list[Instruction]], chunks: int, microbatches: int | None) -> None:
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


def _check_fifo(lists: list[list[Instruction]]) -> None:
    """Between two stages, in each direction, messages are received in the order they were
    sent: a transport that matches by order alone (NCCL's p2p) pairs them right too."""
    p = len(lists)
    sent: dict[tuple, list] = {}
    received: dict[tuple, list] = {}
    for s, ops in enumerate(lists):
        for op in ops:
            if isinstance(op, (SendActivation, SendGrad, RecvActivation, RecvGrad)):
                key = message_key(s, op, p)
                other = key[2] % p  # the receiving stage, for a send; for a receive, the sender:
                if isinstance(op, RecvActivation):
                    other = (key[2] - 1) % p
                elif isinstance(op, RecvGrad):
                    other = (key[2] + 1) % p
                pair = (s, other, key[0]) if isinstance(op, (SendActivation, SendGrad)) else (other, s, key[0])
                (sent if isinstance(op, (SendActivation, SendGrad)) else received).setdefault(pair, []).append(key)
    for pair, keys in sent.items():
        if received.get(pair) != keys:
            raise ScheduleError(f"stage {pair[0]} sends {pair[2]}s to stage {pair[1]} in another order than "
                                f"it receives them")


def _peak_inflight(lists: list[list[Instruction]]) -> list[int]:
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

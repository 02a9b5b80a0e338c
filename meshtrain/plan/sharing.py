"""A pipeline's step on ranks that share cores: the schedule's instruction lists run with
each stage's own forward and backward times, and the ranks that are computing at a moment
share the machine's cores (processor sharing: k busy ranks on c cores run at min(1, c/k)
of full speed each). A CPU with fewer cores than ranks makes a stage run faster while the
others wait for it — the bubble is partly filled — and stages of unequal work (the head's
stage) set the pace only where they are on the critical path. With cores to spare it is
the schedule's makespan with per-stage costs; with equal stages, the closed forms.

Every rank of a stage (its dp × tp copies) runs the same list at the same time, so a stage
counts as that many busy ranks while it computes."""

from __future__ import annotations

from functools import lru_cache

from meshtrain.parallel.pipeline.schedules import (COMPUTE, Backward, BackwardInput, Forward, RecvActivation,
                                                   RecvGrad, SendActivation, SendGrad, flat, schedule)
from meshtrain.parallel.pipeline.simulate import message_key


@lru_cache(maxsize=4096)
def pipeline_time(schedule_name: str, microbatches: int, chunks: int, stage_costs: tuple[tuple[float, float], ...],
                  ranks_per_stage: int, cores: float) -> tuple[float, tuple[float, ...]]:
    """(makespan, each stage's time spent computing) of one step's micro-batches.
    `stage_costs[s]`: (forward, backward) seconds of one micro-batch through all of stage s
    at full speed, or (forward, input pass, weight pass) for a zero-bubble stage whose split
    is known (else each pass takes half of the backward); a chunk of an interleaved stage
    takes 1/chunks of it."""
    p = len(stage_costs)
    lists = [flat(ops) for ops in schedule(schedule_name, p, microbatches, chunks)]  # sends buffered
    at, left = [0] * p, [None] * p  # next instruction; work left of the computation running
    busy = [0.0] * p
    sent: dict[tuple, float] = {}
    now = 0.0

    def work(s: int, op) -> float:
        forward, *backward = stage_costs[s]
        split = backward if len(backward) == 2 else [backward[0] / 2] * 2
        full = (forward if isinstance(op, Forward) else sum(split) if isinstance(op, Backward)
                else split[0] if isinstance(op, BackwardInput) else split[1])
        return full / chunks

    while True:
        moved = True
        while moved:  # sends and receives take no time: run them until every stage computes or waits
            moved = False
            for s in range(p):
                while at[s] < len(lists[s]) and left[s] is None:
                    op = lists[s][at[s]]
                    if isinstance(op, (SendActivation, SendGrad)):
                        sent[message_key(s, op, p)] = now
                    elif isinstance(op, (RecvActivation, RecvGrad)):
                        if sent.pop(message_key(s, op, p), None) is None:
                            break  # its sender has not got there yet
                    elif isinstance(op, COMPUTE):
                        left[s] = work(s, op)
                        break
                    at[s] += 1
                    moved = True
        running = [s for s in range(p) if left[s] is not None]
        if not running:
            return now, tuple(busy)  # the schedules are proven free of deadlock by simulate()
        speed = min(1.0, cores / (ranks_per_stage * len(running)))
        dt = min(left[s] for s in running) / speed
        now += dt
        for s in running:
            busy[s] += dt
            left[s] -= speed * dt
            if left[s] <= 1e-12 * max(1.0, dt):
                left[s] = None
                at[s] += 1

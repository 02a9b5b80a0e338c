"""`meshtrain plan --search`: every valid layout of a workload on `gpus` devices, those that
fit ranked by predicted step time.

The space: tp a divisor of the GPUs that fits in a node (and divides heads, key/value heads,
the MLP width — a MoE's dense layers'; its experts stay whole — and the vocabulary; none
for a whole-projection q/k norm), cp a divisor of the rest that cuts the sequence into 2·cp
chunks (by the ring, and by all-to-all where the heads left by tp divide by cp), pp a
divisor of what remains, dp the rest (dividing the batch); ZeRO 0–3 (0 alone when dp·cp = 1:
ZeRO shards over the parameters' dp × cp replicas); SP on or off under tp; no, selective or full
recompute; every micro-batch size that divides a replica's batch; under pp, 1F1B, the
zero-bubble schedule and interleaved 1F1B with 2 chunks; for a MoE, ep every divisor of
dp·cp·tp that divides the experts (expert parallelism folds over those ranks). Precision, gradient dtype,
attention and dropout are the workload's, not searched.

It is exhaustive — each candidate is planned — with one shortcut that cannot change the
answer: a layout that does not fit is not timed. The simulator's bubble is memoised per
(schedule, p, m, v), and a plan evaluates one stage of each kind, so ~10⁴ candidates take
a few seconds."""

from __future__ import annotations

from dataclasses import replace
from itertools import product
from typing import Iterator

from meshtrain.parallel.options import CP_MODES, Layout
from meshtrain.plan.planner import PlanError, Workload, check, plan

RECOMPUTE_CHOICES = ("none", "selective", "full")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _context_choices(work: Workload, rest: int) -> Iterator[tuple[int, str]]:
    """(cp, mode) for the devices left after tp: no cp, then every divisor cp > 1 that
    splits the sequence into 2·cp chunks, by the ring and (`check` keeps it only where the
    heads divide) by all-to-all."""
    yield 1, "ring"
    for cp in _divisors(rest)[1:]:
        if work.seq % (2 * cp) == 0:
            yield from ((cp, mode) for mode in CP_MODES)


def layouts(work: Workload, gpus: int, gpus_per_node: int, base: Layout) -> Iterator[Layout]:
    """Every layout `check` accepts for `gpus` devices (`base` gives what is not searched)."""
    shape = work.shape
    for tp in _divisors(gpus):
        if tp > gpus_per_node:
            break
        for cp, cp_mode in _context_choices(work, gpus // tp):
            for pp in _divisors(gpus // (tp * cp)):
                dp = gpus // (tp * cp * pp)
                if work.batch % dp or pp > shape.layers:
                    continue
                schedules = [("1f1b", 1)] + ([("zb", 1), ("interleaved", 2)] if pp > 1 else [])
                for zero in (0, 1, 2, 3) if dp * cp > 1 else (0,):
                    for sp in (False, True) if tp > 1 else (False,):
                        for recompute in RECOMPUTE_CHOICES:
                            for b in _divisors(work.batch // dp):
                                m = work.batch // (dp * b)
                                for (schedule, chunks), ep in product(schedules, _expert_choices(shape, dp * cp * tp)):
                                    lay = replace(base, dp=dp, tp=tp, pp=pp, cp=cp, cp_mode=cp_mode, zero=zero, sp=sp,
                                                  recompute=recompute, microbatches=m, schedule=schedule,
                                                  chunks=chunks, stage_layers="", ep=ep)
                                    try:
                                        check(work, lay, gpus)
                                    except PlanError:
                                        continue
                                    yield lay


def _expert_choices(shape, fold: int) -> list[int]:
    """ep for a MoE: every divisor of the dp·cp·tp ranks it folds over that divides the
    experts; 1 for a dense model."""
    if shape.kind != "moe":
        return [1]
    return [e for e in _divisors(fold) if shape.experts % e == 0]


def search(work: Workload, gpus: int, machine, *, memory_bytes: float, gpus_per_node: int = 8,
           peak_flops: float | None = None, accounting: str = "torch", base: Layout | None = None,
           top: int = 10, where=None) -> dict:
    """The `top` fitting layouts by predicted step time, with how many were tried and fit,
    and the layout that needs the least memory with what it needs (`closest`, `least_bytes`:
    to say by how much nothing fits). `where(layout)`: only the layouts it accepts (the axes
    a user fixed)."""
    base = base or Layout()
    tried, ranked = 0, []
    for lay in layouts(work, gpus, gpus_per_node, base):
        if where is not None and not where(lay):
            continue
        tried += 1
        result = plan(work, lay, machine, memory_bytes=memory_bytes, gpus_per_node=gpus_per_node,
                      peak_flops=peak_flops, accounting=accounting, time_unfit=False)
        if result is None:
            continue
        ranked.append((result["predicted_step_time_s"], result["total_bytes"], lay, result))
    ranked.sort(key=lambda r: (r[0], r[1]))
    closest, least = None, None
    if not ranked and tried:
        closest, least = _least_memory(work, gpus, gpus_per_node, base, accounting, where, machine)
    return {"tried": tried, "fit": len(ranked), "best": [(lay, result) for _, _, lay, result in ranked[:top]],
            "least_bytes": least, "closest": closest}


def _least_memory(work, gpus, gpus_per_node, base, accounting, where, machine) -> tuple[Layout, float]:
    """The layout of least memory and its bytes, among the full-recompute, smallest-micro-batch
    layouts where there are such (they need the least), else among all `where` accepts."""
    accepted = [lay for lay in layouts(work, gpus, gpus_per_node, base) if where is None or where(lay)]
    leanest = [lay for lay in accepted if lay.recompute == "full" and lay.microbatches == work.batch // lay.dp]
    sized = [(plan(work, lay, machine, gpus_per_node=gpus_per_node, accounting=accounting)["total_bytes"], i, lay)
             for i, lay in enumerate(leanest or accepted)]
    least, _, lay = min(sized)
    return lay, least

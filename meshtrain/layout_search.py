"""A layout search on the ranks (`train --layout-search`, `meshtrain.search_layout`): the
planner proposed the candidates (`search_plan.propose`); here each is built on process
groups of its own by the caller's `trial` and run for a few steps, and the fastest measured
is chosen.

A candidate runs `WARMUP_STEPS` + `MEASURED_STEPS` steps on the run's first batches; its step
time is the median of the measured ones (the slowest rank's), its peak memory what the
first step reached (the allocator's peak on a GPU; on the CPU the model states plus the
activation meter's peak, the planner's own accounting), each the largest over the ranks, so
every rank takes every decision alike. A candidate is skipped, with its reason, when that
peak goes over the budget, when it would run past the search's time, or when every rank
refuses it alike (a routing over `--ep-max-load`, say). A real out-of-memory on a device is
not something ranks recover from together; the planner's prediction keeps those out.

Nothing of the profile stays: its jobs, optimizer states and groups are released, the RNG
states put back, and the run's data is read by step (the steps profiled are read again), so
the searched run trains as the same layout run by hand."""

from __future__ import annotations

import gc
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from meshtrain.comm import broadcast_from_rank_0
from meshtrain.mesh import Mesh
from meshtrain.metrics import ActivationMeter
from meshtrain.search_plan import (MEASURED_STEPS, REFUSED, WARMUP_STEPS, Candidate, SearchPlan, SearchRefused,
                                   SearchStore, choose, over_budget, table)


def search_on_ranks(plan: SearchPlan | SearchRefused | None, device: torch.device, trial, *,
                    result: Path | None = None, out=sys.stdout) -> SearchPlan:
    """Collective over the default group (one process: no group): rank 0's plan (a refusal
    there is raised on every rank; the others may pass None), profiled
    (unless it was reused or resumed) with `trial(layout, mesh) -> (job, step)`, where
    `step(k, meter)` runs the k-th step and returns its `StepOutput`; its choice made. Rank 0
    prints the table to `out` (None: not), writes the record to `result` and the machine's
    store. Raises SearchRefused (every rank) when no candidate could train."""
    main = _rank() == 0
    if dist.is_initialized():
        plan = broadcast_from_rank_0(plan, None, device)
    if isinstance(plan, SearchRefused):
        raise plan
    if plan.chosen is None:
        _profile(plan, device, trial, say=main and out is not None)
        if plan.chosen is None:
            raise SearchRefused("the layout search: no candidate could train: "
                                + "; ".join(f"{c.layout.short()}: {c.skipped}" for c in plan.candidates)
                                + "; raise the memory per rank, or give the layout")
        if main:
            SearchStore().save(plan)
    if main:
        _write(plan, result, out)
    return plan


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _profile(plan: SearchPlan, device: torch.device, trial, say: bool) -> None:
    rng = _rng_states()
    start = time.perf_counter()
    correction = 1.0  # measured over predicted step time, from the candidates measured so far
    try:
        for i, c in enumerate(plan.candidates):
            need = (WARMUP_STEPS + MEASURED_STEPS) * c.predicted_step_s * correction
            left = plan.budget_s - _elapsed(start, device)
            if need > left:
                c.skipped = f"out of the search's time (~{need:.3g} s needed, {max(0.0, left):.3g} s left)"
                continue
            if say:
                print(f"meshtrain: layout search: profiling {i + 1}/{len(plan.candidates)}: {c.layout.short()} "
                      f"recompute={c.layout.recompute}", file=sys.stderr, flush=True)
            _run_candidate(plan, c, device, start, trial)
            if c.measured_step_s is not None and c.predicted_step_s > 0:
                correction = max(correction, c.measured_step_s / c.predicted_step_s)
    finally:
        _restore(rng)
    plan.profile_s = _elapsed(start, device)
    plan.chosen = choose(plan.candidates, plan.memory_bytes)


def _run_candidate(plan: SearchPlan, c: Candidate, device: torch.device, start: float, trial) -> None:
    """Build the candidate on new groups, run its steps, release it all."""
    lay = c.layout
    mesh = (Mesh.build(lay.pp, lay.dp, lay.tp, device, cp=lay.cp, ep=lay.ep) if dist.is_initialized()
            else Mesh.single(device))
    job = step = None
    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        job, step = trial(lay, mesh)
        meter, times = ActivationMeter(), []
        for k in range(WARMUP_STEPS + MEASURED_STEPS):
            if k and _elapsed(start, device) > plan.budget_s:
                c.skipped = f"ran out of the search's time after {k} steps"
                return
            t0 = time.perf_counter()
            step(k, meter if k == 0 else None).loss  # read: the step has finished on the device
            times.append(time.perf_counter() - t0)
            if k == 0:
                c.measured_peak_bytes = _largest(_peak_bytes(job, meter, device), device)
                if c.measured_peak_bytes > plan.memory_bytes:
                    c.skipped = over_budget(c.measured_peak_bytes, plan.memory_bytes)
                    return
        c.measured_step_s = _largest(statistics.median(times[WARMUP_STEPS:]), device)
    except ValueError as e:  # refused alike on every rank (a bound, a model's own rule)
        c.skipped = REFUSED + str(e).splitlines()[0][:200]
    finally:
        del job, step
        _release(mesh)


def _peak_bytes(job, meter: ActivationMeter, device: torch.device) -> float:
    """The first step's peak: the allocator's on a GPU; on the CPU the model states and the
    activations the meter saw, as the planner counts them."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    return float(job.parallel.model_state_bytes()["total"] + meter.peak)


def _largest(value: float, device: torch.device) -> float:
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _elapsed(start: float, device: torch.device) -> float:
    """Seconds since `start` on the slowest clock: every rank decides alike."""
    return _largest(time.perf_counter() - start, device)


def _release(mesh: Mesh) -> None:
    """The candidate's groups (the world's own stays) and whatever its job held."""
    gc.collect()
    for group in mesh.groups():
        if group is not None and group != dist.group.WORLD:
            dist.destroy_process_group(group)
    if mesh.device.type == "cuda":
        torch.cuda.empty_cache()


def _rng_states() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return torch.get_rng_state(), cuda, random.getstate()


def _restore(states: tuple) -> None:
    cpu, cuda, py = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(py)


def _write(plan: SearchPlan, result: Path | None, out) -> None:
    import json

    from meshtrain.atomic import atomic_write

    if out is not None:
        chosen = plan.candidates[plan.chosen].layout
        print("layout search:", file=out)
        table(plan, out=out)
        print(f"training {chosen.short()} recompute={chosen.recompute}", file=out, flush=True)
    if result is not None:
        text = json.dumps(plan.record(), indent=1) + "\n"
        atomic_write(result, lambda tmp: tmp.write_text(text))

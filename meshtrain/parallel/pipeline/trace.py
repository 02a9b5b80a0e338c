"""The measured side of a pipeline, to hold the simulator against: `train --trace` records
when each stage ran each compute instruction, step by step, and the one-way time of a p2p
transfer; `schedule --trace` feeds those measured costs to the simulator and compares its
makespan and order of operations with the run's.

Times are seconds from the step's start; traced steps start with a barrier over the
pipeline, so the stages' clocks start together (to the barrier's skew, microseconds on one
host). On CUDA every stamp synchronises the device first: tracing slows a run down."""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from meshtrain.parallel.pipeline import schedules as S
from meshtrain.parallel.pipeline.simulate import Simulation, Span, simulate

KINDS = {S.Forward: "F", S.Backward: "B", S.BackwardInput: "I", S.BackwardWeight: "W"}
OPS = {kind: op for op, kind in KINDS.items()}
P2P_ROUNDS = 20


class Recorder:
    """One stage's timeline of compute instructions, one list per step."""

    def __init__(self, device: torch.device):
        self._sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.steps: list[list[dict]] = []

    def start_step(self) -> None:
        self._sync()
        self._t0 = time.perf_counter()
        self.steps.append([])

    @contextmanager
    def timing(self, op: S.Instruction):
        if type(op) not in KINDS:
            yield
            return
        self._sync()
        start = time.perf_counter()
        yield
        self._sync()
        self.steps[-1].append({"op": KINDS[type(op)], "mb": op.mb, "chunk": op.chunk,
                               "start": start - self._t0, "end": time.perf_counter() - self._t0})


def measure_p2p(comm, axis: str, shape: tuple[int, ...], dtype: torch.dtype) -> float:
    """The median one-way time of an activation-sized message: every stage sends to the next
    and receives from the previous (a ring), timed over a few rounds. Collective over `axis`."""
    out = torch.zeros(shape, dtype=dtype, device=comm.mesh.device)
    into = torch.empty_like(out)
    s, p = comm.mesh.coord(axis), comm.mesh.size(axis)
    to_next, from_previous = (s + 1) % p - s, (s - 1) % p - s
    times = []
    for _ in range(P2P_ROUNDS + 1):
        comm.barrier(axis)
        start = time.perf_counter()
        works = comm.exchange([(True, out, to_next, 0), (False, into, from_previous, 0)], axis, purpose="trace")
        for w in works:
            w.wait()
        if out.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


# ---- reading a trace back -------------------------------------------------------------------

@dataclass(frozen=True)
class MeasuredCosts:
    """The simulator's costs taken from a trace: the median duration of each (stage, chunk,
    kind) over the steps after the first (warm-up), and the measured p2p time per transfer."""
    durations: dict
    transfer: float

    @classmethod
    def from_trace(cls, trace: dict) -> "MeasuredCosts":
        samples: dict[tuple, list[float]] = {}
        for step in trace["steps"][1:] or trace["steps"]:
            for stage, spans in enumerate(step):
                for sp in spans:
                    samples.setdefault((stage, sp["chunk"], sp["op"]), []).append(sp["end"] - sp["start"])
        return cls({key: statistics.median(v) for key, v in samples.items()}, trace["p2p_s"])

    def of(self, op: S.Instruction, chunks: int, stage: int = 0) -> float:
        kind = KINDS.get(type(op))
        return 0.0 if kind is None else self.durations[(stage, op.chunk, kind)]


def measured_simulation(trace: dict, step: int) -> Simulation:
    """A traced step in the simulator's shape, to draw beside the prediction."""
    spans = [Span(stage, sp["start"], sp["end"], OPS[sp["op"]](sp["mb"], sp["chunk"]))
             for stage, stage_spans in enumerate(trace["steps"][step]) for sp in stage_spans]
    makespan = max(sp.end for sp in spans)
    busy = [sum(sp.end - sp.start for sp in spans if sp.stage == s) for s in range(trace["pp"])]
    return Simulation(trace["pp"], trace["chunks"], spans, makespan, busy, [])


def order(sim: Simulation, stage: int) -> list[tuple]:
    return [(KINDS[type(sp.op)], sp.op.mb, sp.op.chunk) for sp in sorted(sim.spans, key=lambda sp: sp.start)
            if sp.stage == stage]


def per_stage(costs: MeasuredCosts, stages: int) -> list[dict[str, float]]:
    """Each stage's median duration of each kind of operation (F, B; I and W, the input and
    weight passes, under zero-bubble), its chunks summed — the F, B and W a planner is
    calibrated from (`planner.ZB_INPUT_SHARE` is the last stage's I ÷ (I + W))."""
    out = [{} for _ in range(stages)]
    for (stage, _, kind), t in sorted(costs.durations.items()):
        out[stage][kind] = out[stage].get(kind, 0.0) + t
    return out


def compare(trace: dict) -> dict:
    """The simulator fed with the trace's measured costs against the traced run itself: the
    predicted makespan, the median measured one (steps after the first), whether each stage
    ran its operations in the predicted order, each stage's median operations, and the
    pictures' inputs."""
    lists = S.schedule(trace["schedule"], trace["pp"], trace["microbatches"], trace["chunks"])
    costs = MeasuredCosts.from_trace(trace)
    predicted = simulate(lists, trace["chunks"], costs, trace["microbatches"])
    steps = range(1, len(trace["steps"])) if len(trace["steps"]) > 1 else range(1)
    measured = [measured_simulation(trace, i) for i in steps]
    makespans = [m.makespan for m in measured]
    median_step = measured[makespans.index(sorted(makespans)[len(makespans) // 2])]
    measured_makespan = statistics.median(makespans)
    return {
        "schedule": trace["schedule"], "pp": trace["pp"], "microbatches": trace["microbatches"],
        "chunks": trace["chunks"], "p2p_s": trace["p2p_s"],
        "predicted_makespan_s": float(predicted.makespan), "measured_makespan_s": measured_makespan,
        "predicted_over_measured": float(predicted.makespan) / measured_makespan,
        "same_order": all(order(m, s) == order(predicted, s) for m in measured for s in range(trace["pp"])),
        "op_median_s_per_stage": per_stage(costs, trace["pp"]),
        "predicted": predicted, "measured": median_step,
    }

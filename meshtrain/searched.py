"""`meshtrain.search_layout`: `train --layout-search` for a model of your own. Every rank
calls it alike (under torchrun, srun or mpirun; or as one process): the planner ranks the
layouts of the world from the model's shape, the fastest that fit are profiled on these
ranks with your model, optimizer, loss and batches (`layout_search.search_on_ranks`), and
what it returns is the layout to train:

    found = meshtrain.search_layout(make_model, batches, shape=meshtrain.Shape(...),
                                    optimizer=factory, loss_fn=meshtrain.cross_entropy,
                                    tp_plan=TP_PLAN, pipeline=PIPELINE)
    mesh = meshtrain.init(**found.mesh)
    job = meshtrain.parallelize(make_model(), mesh, optimizer=factory, tp_plan=TP_PLAN,
                                pipeline=PIPELINE, **found.options)

The planner models transformers: `shape` says what yours is (a `Shape`, or the name of a
preset or published architecture of the same shape). The axes your model supports are
searched: tensor (and sequence) parallelism with a `tp_plan`, pipelines with a `pipeline`,
data parallelism and ZeRO, micro-batches and recompute always; context and expert
parallelism only where you fix them. Keyword arguments named after an axis (`tp=2`,
`zero=3`) fix it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from meshtrain.loss_terms import cross_entropy
from meshtrain.parallel.options import Layout
from meshtrain.search_plan import RESULT_FILE, SEARCHED, Request, SearchRefused, key_of, machine_name, propose

MESH_AXES = ("dp", "tp", "pp", "cp", "ep")


@dataclass
class SearchedLayout:
    """What the search chose: `mesh`, `meshtrain.init`'s axes; `options`, the layout's
    arguments of `meshtrain.parallelize`; `record`, the search (its candidates, predicted and
    measured, `chosen` and `profile_s`: `OUT/layout-search.json`'s keys)."""
    mesh: dict
    options: dict
    record: dict


def search_layout(make_model, batches, *, shape, optimizer, loss_fn=cross_entropy, vocab_size: int = 2048,
                  candidates: int = 3, memory_per_rank=None, mem_headroom: float = 0.1, budget: float = 600.0,
                  machine: str | None = None,
                  reprofile: bool = False, device: str = "auto", seed: int = 0, precision: str = "fp32",
                  tp_plan=None, pipeline=None, clip_grad_norm: float | None = None, out: str | None = None,
                  verbose: bool = True, **fixed) -> SearchedLayout:
    """Collective: the fastest measured layout of this world for `make_model()` (called once
    per candidate, alike on every rank). `batches`: the global batches, `batches(k)` or a
    sequence (used in turn), each (inputs [rows, seq], targets); the profile runs 7 steps.
    `shape`: the model's shape for the planner (a `meshtrain.Shape`, or the name of a preset
    or published architecture, at `vocab_size`). `memory_per_rank`: bytes or "12GiB" (default:
    a GPU's memory less `mem_headroom`, the host's available memory over its local ranks on
    the CPU).
    `budget`: seconds the profile may take. `machine`: a profile from `meshtrain plan
    --calibrate` (default: on the CPU this host's, which `train --layout-search` measured once
    — without either the search is refused; on a GPU its preset's roofline). `out`: a folder
    to write `layout-search.json` in. `fixed`: axes held (dp, tp, pp, cp, cp_mode, ep, zero, sp,
    schedule, chunks, microbatches, recompute). A bad argument, or a world or budget with no
    layout, raises `SearchRefused` (a ValueError) on every rank before anything trains."""
    import sys

    import meshtrain
    from meshtrain.layout_search import search_on_ranks
    from meshtrain.plan.planner import Workload

    unknown = sorted(set(fixed) - set(SEARCHED))
    if unknown:
        raise TypeError(f"search_layout() got unexpected keyword argument(s) {', '.join(unknown)}; the axes it fixes: "
                        f"{', '.join(SEARCHED)}")
    batch_of = _batches(batches)
    inputs = batch_of(0)[0]
    if getattr(inputs, "ndim", 0) < 2:
        raise ValueError("search_layout: each batch's inputs must be a [rows, seq] tensor (the planner plans "
                         "sequences)")
    first = meshtrain.init(device=device, seed=seed)  # joins the world (dp fills it)
    world, device_t = first.world_size, first.device
    work = Workload(_shape(shape, vocab_size), int(inputs.shape[0]), int(inputs.shape[1]),
                    device=device_t.type)
    base = Layout(precision=precision)

    def allowed(lay: Layout) -> bool:
        """What a model of one's own supports without being told more."""
        return ((lay.tp == 1 or tp_plan is not None) and (not lay.sp or tp_plan is not None)
                and (lay.pp == 1 or pipeline is not None) and (lay.cp == 1 or "cp" in fixed)
                and (lay.ep == 1 or "ep" in fixed))
    request = Request("your model", work, world, _local_world(world), base, dict(fixed), candidates, memory_per_rank,
                      budget, machine, device_t.type, flags=False, allowed=allowed, mem_headroom=mem_headroom)
    key = key_of({"api": True, "shape": repr(work.shape), "batch": work.batch, "seq": work.seq, "world": world,
                  "fixed": fixed, "precision": precision, "tp_plan": tp_plan is not None,
                  "pipeline": pipeline is not None, "machine": machine_name(machine, device_t.type)})
    plan = None
    if first.is_main:  # rank 0 plans; its plan, or its refusal, is every rank's (`search_on_ranks`)
        try:
            plan = propose(request, lambda lay: lay, key, reprofile=reprofile)
        except SearchRefused as e:
            plan = SearchRefused(f"search_layout: {e}")

    def trial(layout: Layout, mesh):
        mesh.seed = seed
        job = meshtrain.parallelize(make_model(), mesh, optimizer=optimizer, loss_fn=loss_fn, tp_plan=tp_plan,
                                    pipeline=pipeline, clip_grad_norm=clip_grad_norm, **_options(layout))

        def step(k: int, meter):
            job.steps = k
            return job.update(job.backward(*batch_of(k), meter=meter))
        return job, step
    result = Path(out, RESULT_FILE) if out is not None else None
    done = search_on_ranks(plan, device_t, trial, result=result, out=sys.stdout if verbose else None)
    lay = done.candidates[done.chosen].layout
    return SearchedLayout({axis: getattr(lay, axis) for axis in MESH_AXES}, _options(lay), done.record())


def _options(lay: Layout) -> dict:
    """`parallelize`'s layout arguments for `lay`."""
    return {"zero": lay.zero, "precision": lay.precision, "recompute": lay.recompute, "sp": lay.sp,
            "schedule": lay.schedule, "chunks": lay.chunks, "microbatches": lay.microbatches, "cp_mode": lay.cp_mode}


def _batches(batches):
    if callable(batches):
        return batches
    seq = list(batches)
    if not seq:
        raise ValueError("search_layout: batches is empty; give at least one (inputs, targets)")
    return lambda k: seq[k % len(seq)]


def _shape(shape, vocab_size: int):
    from meshtrain.plan.shapes import Shape
    from meshtrain.recipes import shape_of

    if isinstance(shape, Shape):
        return shape
    if isinstance(shape, str):
        try:
            return shape_of(shape, vocab_size)
        except ValueError as e:
            raise ValueError(f"search_layout: shape={shape!r}: {e}") from None
    raise TypeError("search_layout: shape= a meshtrain.Shape, or the name of a preset or published architecture")


def _local_world(world: int) -> int:
    import os
    return int(os.environ.get("LOCAL_WORLD_SIZE", world))

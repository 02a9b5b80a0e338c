"""A layout search's plan, independent of where it was asked (`train --layout-search`,
`meshtrain.search_layout`): the planner's candidates for a world and a memory budget
(`propose`), the record of what the profile measured (`SearchPlan`, `Candidate`), the
choice (`choose`), what each machine measured (`SearchStore`), and the table both the
search and `plan --search` print (`layout_table`).

The planner ranks every valid layout of the world (`plan.search`: every axis meshtrain has,
ep on a MoE; the axes the user fixed kept), keeps those whose predicted memory fits a rank's
budget, and takes the requested number of the fastest predicted that the trainer accepts:
among those the planner cannot tell apart (within its ~15 % error) one of each mesh first,
so that the profile measures the axes, not only the variants of one (`spread`). Where none
can be proposed it says why in one line (`SearchRefused`): a budget nothing fits (with the
layout that comes closest and by how much), a world with no valid layout, fixed axes that
leave nothing to search, a time budget below one candidate's warm-up. The ranks profile the
candidates (`layout_search`)."""

from __future__ import annotations

import hashlib
import json
import platform
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from meshtrain.atomic import atomic_write
from meshtrain.parallel.options import Layout

RESULT_FILE = "layout-search.json"
REFUSED = "refused: "  # a skipped candidate's reason when every rank refused it
WARMUP_STEPS, MEASURED_STEPS = 2, 5
# The axes the search chooses; any of them given as a flag (or in the TOML file) is fixed.
SEARCHED = ("dp", "tp", "pp", "cp", "cp_mode", "ep", "zero", "sp", "schedule", "chunks", "microbatches", "recompute")
PLANNER_ERROR = 0.15  # the planner's step time against the trainer's (docs/planner.md)
GPU_HEADROOM = 0.1  # `plan --mem-headroom`'s default: the CUDA context, the allocator's cache
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


class SearchRefused(ValueError):
    """No candidate can be proposed, or none could train: one line saying why."""


@dataclass
class Candidate:
    layout: Layout
    predicted_step_s: float
    predicted_peak_bytes: float
    measured_step_s: float | None = None
    measured_peak_bytes: float | None = None
    skipped: str | None = None  # why it was not measured to the end (None: measured)

    def record(self) -> dict:
        """The JSON contract's candidate: `layout` as the run's `layout` object."""
        return {"layout": layout_record(self.layout), "predicted_step_s": self.predicted_step_s,
                "measured_step_s": self.measured_step_s, "predicted_peak_bytes": round(self.predicted_peak_bytes),
                "measured_peak_bytes": None if self.measured_peak_bytes is None else round(self.measured_peak_bytes),
                "skipped": self.skipped}


@dataclass
class SearchPlan:
    """What the ranks profile, decided before they start (rank 0's copy is every rank's)."""
    world: int
    candidates: list[Candidate]
    memory_bytes: float  # a rank's budget
    memory_source: str  # where the budget came from, for the table
    budget_s: float
    key: str  # this workload on this machine (`SearchStore`)
    tried: int
    fit: int
    machine: str  # what the planner predicted with
    batch: int  # the global batch, in sequences
    reused: str | None = None  # the measurements taken from an earlier search (a path), or None
    resumed: bool = False  # a resumed run: its earlier choice, no profile
    chosen: int | None = None  # set when reused or resumed
    profile_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    def record(self) -> dict:
        """`OUT/layout-search.json` and `--json`'s `layout_search`."""
        return {"candidates": [c.record() for c in self.candidates], "chosen": self.chosen,
                "profile_s": round(self.profile_s, 3), "world": self.world,
                "memory_per_rank_bytes": round(self.memory_bytes), "search_budget_s": self.budget_s,
                "tried": self.tried, "fit": self.fit, "machine": self.machine, "batch": self.batch,
                "reused": self.reused,
                "resumed": self.resumed}


def layout_record(lay: Layout) -> dict:
    """A layout as the run's `layout` object, with what the search also chooses (chunks)."""
    return lay.summary() | {"chunks": lay.chunks}


def parse_size(text: str) -> float:
    """'12GiB', '800 MiB', '2.5e9' -> bytes; ValueError with the forms it takes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"--memory-per-rank {text}: give a size such as 12GiB, 800MiB or 2e9 (bytes)")
    return float(match.group(1)) * _UNITS[unit]


@dataclass
class Request:
    """What a search is asked, from the command line or `meshtrain.search_layout`."""
    name: str  # the model, for the messages
    work: object  # the planner's `Workload`
    world: int
    local_world: int  # ranks on one host (tp stays inside it; they share the CPU's memory)
    base: Layout  # the options not searched (precision, ...)
    fixed: dict  # searched axes held at these values
    candidates: int
    memory_per_rank: str | float | None
    budget_s: float
    machine: str | None
    device_type: str
    flags: bool  # messages name command-line flags (else the API's arguments)
    allowed: object = None  # a further rule on the layouts (the API's: what the user's model supports)
    mem_headroom: float = GPU_HEADROOM  # the fraction of a GPU's memory kept free


def propose(request: Request, accepted, key: str, *, reprofile: bool) -> SearchPlan:
    """The planner's candidates for `request`: `accepted(layout)` returns the layout to run
    (None: the trainer refuses it). One `SearchRefused` line where there are none."""
    from meshtrain.plan.planner import PlanError
    from meshtrain.plan.search import search

    r = request
    if r.candidates < 1:
        raise SearchRefused(f"{_arg('candidates', r.flags)} {r.candidates}: profile at least one layout")
    if not 0 <= r.mem_headroom < 1:
        raise SearchRefused(f"{_arg('mem_headroom', r.flags)} {r.mem_headroom:g}: give the fraction of a GPU's memory "
                            f"kept free, from 0 to below 1 (default {GPU_HEADROOM:g})")
    if not r.budget_s > 0:
        raise SearchRefused(f"{_arg('search_budget', r.flags)} {r.budget_s:g}: give the seconds the profile may take")
    try:
        rates, peak = planner_rates(r.machine, r.base.precision, r.world, r.device_type)
    except PlanError as e:
        raise SearchRefused(str(e)) from None
    memory, memory_source = memory_budget(r.memory_per_rank, r.device_type, r.local_world, r.flags, r.mem_headroom)
    rules = [rule for rule in (r.allowed, (lambda lay: all(getattr(lay, k) == v for k, v in r.fixed.items()))
                               if r.fixed else None) if rule is not None]
    found = search(r.work, r.world, rates, memory_bytes=memory, gpus_per_node=r.local_world, peak_flops=peak,
                   base=r.base, top=10 ** 6, where=(lambda lay: all(rule(lay) for rule in rules)) if rules else None)
    given = f" with {_given(r.fixed, r.flags)}" if r.fixed else ""
    what = "--world" if r.flags else "the world"
    if not found["tried"]:
        raise SearchRefused(f"no layout of {r.world} ranks runs {r.name} at a batch of {r.work.batch} × "
                            f"{r.work.seq}{given} (tp must divide the heads, pp the blocks, dp the batch); change "
                            f"{what}, the batch or those settings")
    if r.fixed and found["tried"] == 1:
        raise SearchRefused(f"{_given(r.fixed, r.flags)} fix every axis of {r.world} ranks: nothing is left to "
                            f"search; drop " + ("--layout-search, or one of those flags" if r.flags else "one of them"))
    if not found["best"]:
        closest, least = found["closest"], found["least_bytes"]
        raise SearchRefused(f"{r.name} fits no layout of {r.world} ranks{given} in {_size(memory)} per rank "
                            f"({memory_source}): the closest, {closest.short()} recompute={closest.recompute}, needs "
                            f"{_size(least)}, {_size(least - memory)} more; raise "
                            f"{_arg('memory_per_rank', r.flags)}, or use more ranks or a smaller batch")
    candidates = []
    for lay, result in spread(found["best"]):
        run = accepted(lay)
        if run is not None:
            candidates.append(Candidate(run, result["predicted_step_time_s"], result["total_bytes"]))
        if len(candidates) == r.candidates:
            break
    candidates.sort(key=lambda c: c.predicted_step_s)
    if not candidates:
        raise SearchRefused(f"none of the {found['fit']} layouts of {r.world} ranks that fit{given} is one the "
                            f"trainer accepts for {r.name}; give the layout")
    warmup = WARMUP_STEPS * min(c.predicted_step_s for c in candidates)
    if r.budget_s < warmup:
        raise SearchRefused(f"{_arg('search_budget', r.flags)} {r.budget_s:g} s is less than one candidate's warm-up "
                            f"({WARMUP_STEPS} steps, {warmup:.3g} s predicted for the fastest); give at least "
                            f"{warmup:.3g} s")
    plan = SearchPlan(r.world, candidates, memory, memory_source, r.budget_s, key, found["tried"], found["fit"],
                      machine_name(r.machine, r.device_type), r.work.batch)
    if not reprofile:
        SearchStore().reuse(plan)
    return plan


def _arg(name: str, flags: bool) -> str:
    """A setting as the user wrote it: the command line's flag, or `search_layout`'s argument."""
    return f"--{name.replace('_', '-')}" if flags else f"{'budget' if name == 'search_budget' else name}="


def _given(fixed: dict, flags: bool) -> str:
    if flags:
        return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in fixed.items())
    return ", ".join(f"{k}={v!r}" for k, v in fixed.items())


def spread(ranked: list) -> list:
    """The planner's ranking, (layout, plan) fastest first, reordered for the profile: the
    fastest of each mesh (dp, tp, pp, cp, ep) whose prediction is within the planner's error of
    the fastest come first, then the rest in order. The planner's step time is within ~15 %
    of the trainer's (docs/planner.md), so layouts predicted closer than that are a tie it
    cannot break; the variants of one mesh (ZeRO stage, micro-batches) differ less than
    meshes do, and a profile of the three fastest dp variants alone would never measure the
    pipeline or the ring that may beat them."""
    if not ranked:
        return []
    fastest = ranked[0][1]["predicted_step_time_s"]
    first, seen = [], set()
    for i, (lay, result) in enumerate(ranked):
        mesh = (lay.dp, lay.tp, lay.pp, lay.cp, lay.ep)
        if result["predicted_step_time_s"] <= fastest * (1 + PLANNER_ERROR) and mesh not in seen:
            seen.add(mesh)
            first.append(i)
    chosen = set(first)
    return [ranked[i] for i in first] + [r for i, r in enumerate(ranked) if i not in chosen]


def binary_unit(nbytes: float) -> tuple[str, float]:
    """The binary unit sizes up to `nbytes` read best in (the planner's report and this table's)."""
    for name, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(nbytes) >= size:
            return name, size
    return "bytes", 1


def _size(nbytes: float) -> str:
    unit, size = binary_unit(nbytes)
    return f"{nbytes / size:,.2f} {unit}" if size > 1 else f"{nbytes:,.0f} bytes"


def memory_budget(memory_per_rank, device_type: str, local_world: int, flags: bool = True,
                  headroom: float = GPU_HEADROOM) -> tuple[float, str]:
    """A rank's memory: `memory_per_rank` (bytes, or a size such as "12GiB"), else the GPU's
    less the headroom, else the host's available memory over its local ranks."""
    if memory_per_rank is not None:
        try:
            budget = parse_size(memory_per_rank)
        except ValueError as e:
            raise SearchRefused(str(e) if flags else str(e).replace("--memory-per-rank ", "memory_per_rank=")) from None
        return budget, _arg("memory_per_rank", flags)
    if device_type == "cuda":
        import torch
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        return total * (1 - headroom), f"the GPU's {_size(total)} less {_arg('mem_headroom', flags)} {headroom:g}"
    from meshtrain.metrics import available_host_bytes
    available = available_host_bytes()
    if available is None:
        raise SearchRefused(f"the layout search cannot read this host's available memory; give "
                            f"{_arg('memory_per_rank', flags)}")
    return available / local_world, f"the host's available {_size(available)} over {local_world} local ranks"


def planner_rates(machine: str | None, precision: str, world: int, device_type: str):
    """The planner's rates and peak FLOP/s: `machine`'s profile; on a GPU its preset's
    roofline; on the CPU this host's profile in the cache (`host_profile_path`: the command
    line measures it on its first search)."""
    from meshtrain.plan.cluster import GpuRates, cluster_from
    from meshtrain.plan.profile import MachineProfile, ProfileRates

    if machine is None and device_type == "cuda":
        import torch
        cluster = cluster_from(_gpu_preset(torch.cuda.get_device_name()))
        return GpuRates(cluster, precision), cluster.peak_flops(precision)
    path = machine or str(host_profile_path())
    if machine is None and not Path(path).is_file():
        raise SearchRefused("the layout search on the CPU needs a machine profile: make one with `meshtrain plan "
                            "--calibrate --machine FILE` and pass it (--machine FILE, or machine=FILE)")
    try:
        profile = MachineProfile.load(path)
    except ValueError as e:
        raise SearchRefused(str(e)) from None
    rates = ProfileRates(profile, world)
    return rates, rates.peak_flops(precision)


def machine_name(machine: str | None, device_type: str) -> str:
    """What the planner predicts with, in words (and in the store's key)."""
    if machine is None and device_type == "cuda":
        import torch
        return f"{_gpu_preset(torch.cuda.get_device_name())} roofline"
    return f"the profile {machine or host_profile_path()}"


def _gpu_preset(name: str) -> str:
    lowered = name.lower()
    return "h200" if "h200" in lowered else "a100-80g" if "a100" in lowered else "h100-80g"


def host_profile_path() -> Path:
    """This host's machine profile in the cache, measured once by the first search here."""
    from meshtrain.data.datasets import cache_root
    return cache_root() / "machine" / f"{re.sub(r'[^A-Za-z0-9._-]', '_', platform.node())}-cpu.json"


def key_of(what: dict) -> str:
    """A short hash of `what` and this machine (host, device, torch)."""
    import torch
    what = {**what, "host": platform.node(), "device": _device_name(), "torch": torch.__version__}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _device_name() -> str:
    import torch
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def plan_from_record(rec: dict) -> SearchPlan:
    """A search read back from its record (`SearchPlan.record`)."""
    candidates = [Candidate(Layout(**c["layout"]), c["predicted_step_s"],
                            c["predicted_peak_bytes"], c["measured_step_s"], c["measured_peak_bytes"], c["skipped"])
                  for c in rec["candidates"]]
    return SearchPlan(rec["world"], candidates, rec["memory_per_rank_bytes"], "recorded", rec["search_budget_s"], "",
                      rec["tried"], rec["fit"], rec["machine"], rec["batch"], rec.get("reused"), rec.get("resumed", False),
                      rec["chosen"], rec["profile_s"])


class SearchStore:
    """Each search's measurements on this machine, by `search_key`, in the cache: the planner's
    predictions corrected by what this machine measured. A later search of the same key
    whose candidates were all measured there reuses them instead of profiling."""

    def __init__(self, root: Path | None = None):
        from meshtrain.data.datasets import cache_root
        self.root = root or cache_root() / "layout-search"

    def path(self, key: str) -> Path:
        return self.root / f"{key}.json"

    def reuse(self, plan: SearchPlan) -> bool:
        """Fill `plan`'s measurements from the store when every candidate was measured (its
        peak judged again against this budget); whether it did."""
        stored = self.measured(plan.key)
        found = [stored.get(_layout_key(c.layout)) for c in plan.candidates]
        if not all(found) or any(m["measured_step_s"] is None and m["measured_peak_bytes"] <= plan.memory_bytes
                                 for m in found):
            return False
        for c, m in zip(plan.candidates, found):
            c.measured_peak_bytes = m["measured_peak_bytes"]
            if c.measured_peak_bytes > plan.memory_bytes:
                c.skipped = over_budget(c.measured_peak_bytes, plan.memory_bytes)
            else:
                c.measured_step_s = m["measured_step_s"]
        plan.reused = str(self.path(plan.key))
        plan.chosen = choose(plan.candidates, plan.memory_bytes)
        plan.notes.append(f"reused this machine's measurements of these layouts ({plan.reused}); --reprofile "
                          "measures again")
        return True

    def save(self, plan: SearchPlan) -> None:
        """Add what `plan`'s profile measured to the store (rank 0, after the profile): each
        candidate's peak, and its step time where it ran its steps."""
        stored = self.measured(plan.key)
        for c in plan.candidates:
            if c.measured_peak_bytes is None:
                continue  # it never ran (out of the search's time, or refused)
            before = stored.get(_layout_key(c.layout), {})
            stored[_layout_key(c.layout)] = {
                "layout": layout_record(c.layout), "measured_peak_bytes": c.measured_peak_bytes,
                "measured_step_s": c.measured_step_s if c.measured_step_s is not None else before.get("measured_step_s"),
                "predicted_step_s": c.predicted_step_s, "predicted_peak_bytes": c.predicted_peak_bytes}
        path = self.path(plan.key)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"key": plan.key, "machine": plan.machine, "measured": list(stored.values())}, indent=1)
        atomic_write(path, lambda tmp: tmp.write_text(text + "\n"))

    def measured(self, key: str) -> dict:
        """What this machine measured of `key`'s layouts: {`layout_record` as JSON: its record}."""
        try:
            return {_layout_key(Layout(**m["layout"])): m for m in json.loads(self.path(key).read_text())["measured"]}
        except (OSError, ValueError, KeyError, TypeError):
            return {}


def _layout_key(lay: Layout) -> str:
    return json.dumps(layout_record(lay), sort_keys=True)


def over_budget(peak: float, budget: float) -> str:
    return f"measured peak {_size(peak)} over the budget {_size(budget)}"


def choose(candidates: list[Candidate], memory_bytes: float) -> int | None:
    """The fastest measured candidate; where none was measured to the end (each ran out of
    the search's time), the fastest predicted of those neither over the memory budget when
    they ran nor refused; None when there is none."""
    measured = [(c.measured_step_s, i) for i, c in enumerate(candidates) if c.measured_step_s is not None]
    if measured:
        return min(measured)[1]
    usable = [i for i, c in enumerate(candidates) if (c.measured_peak_bytes is None or
                                                      c.measured_peak_bytes <= memory_bytes)
              and not (c.skipped or "").startswith(REFUSED)]
    return usable[0] if usable else None


def table(plan: SearchPlan, out=sys.stdout) -> None:
    """The search's table: each candidate's layout, predicted and measured memory and step
    time, the chosen one, and the profile's time (`plan --search` prints the same shape)."""
    rows = [(c.layout, plan.batch // (c.layout.dp * c.layout.microbatches), c.predicted_peak_bytes,
             c.predicted_step_s, c.measured_peak_bytes, c.measured_step_s,
             "chosen" if i == plan.chosen else (c.skipped or "")) for i, c in enumerate(plan.candidates)]
    print(layout_table(rows), file=out)
    how = ("resumed" if plan.resumed else "reused, measured before" if plan.reused
           else f"profiled in {plan.profile_s:.1f} s of --search-budget {plan.budget_s:g}")
    ranks = f"{plan.world} rank" + ("s" if plan.world != 1 else "")
    print(f"{plan.fit} of {plan.tried} layouts of {ranks} fit {_size(plan.memory_bytes)} per rank "
          f"({plan.memory_source}); predicted with {plan.machine}; {how}", file=out)
    for note in plan.notes:
        print(f"  {note}", file=out)


def layout_table(rows) -> str:
    """Rows of (layout, micro-batch rows, predicted bytes, predicted s, measured bytes,
    measured s, note) as the one table `plan --search` and `train --layout-search` print
    (None: not measured)."""
    unit, size = binary_unit(max((r[2] for r in rows), default=0))
    lines = [f"{'#':>3} {'dp':>3} {'zero':>4} {'cp':>3} {'cp mode':<8} {'tp':>3} {'sp':>3} {'ep':>3} {'pp':>3} "
             f"{'schedule':<14} {'mb':>3} {'m':>4} {'recompute':<10} {'pred ' + unit:>9} {'pred s':>9} "
             f"{'meas ' + unit:>9} {'meas s':>9}"]
    for i, (lay, rows_per_micro, pb, ps, mb, ms, note) in enumerate(rows, 1):
        sched = lay.schedule + (f"×{lay.chunks}" if lay.chunks > 1 else "") if lay.pp > 1 else "-"
        cp_mode = lay.cp_mode if lay.cp > 1 else "-"
        measured_bytes = "-" if mb is None else f"{mb / size:,.1f}"
        measured_s = "-" if ms is None else f"{ms:.4g}"
        lines.append(f"{i:>3} {lay.dp:>3} {lay.zero:>4} {lay.cp:>3} {cp_mode:<8} {lay.tp:>3} "
                     f"{'y' if lay.sp else '-':>3} {lay.ep:>3} {lay.pp:>3} {sched:<14} {rows_per_micro:>3} "
                     f"{lay.microbatches:>4} {lay.recompute:<10} {pb / size:>9,.1f} {ps:>9.4g} {measured_bytes:>9} "
                     f"{measured_s:>9}  {note}".rstrip())
    return "\n".join(lines)

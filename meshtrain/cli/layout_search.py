"""`train --layout-search`, before any rank trains: the configuration as a search request
(`search_plan.propose` ranks and picks the candidates), each candidate checked by `train`'s
own `validate`; bad input refused here, one line each, exit 2, before any rank trains. On
the CPU without `--machine`, the first search here measures this host for the planner
(`plan --calibrate`, into the cache). `--resume` (or a restart) of a searched run trains the
layout it chose (`OUT/layout-search.json`). The ranks then profile the candidates with
`config_trial` (`meshtrain.layout_search`)."""

from __future__ import annotations

import copy
import json
import os
from dataclasses import replace
from pathlib import Path

import meshtrain.cli.config as C
from meshtrain.parallel.options import Layout
from meshtrain.search_plan import (RESULT_FILE, SEARCHED, Request, SearchPlan, SearchRefused, host_profile_path,
                                   key_of, machine_name, plan_from_record, propose)

DEFAULT_WORLD = 2


def world_of(cfg: C.Config, launched_world: int | None) -> int:
    """The ranks the search lays out: the launcher's, or --world from a shell."""
    world = cfg.search.world
    if launched_world is not None:
        if world is not None and world != launched_world:
            raise C.ConfigError(f"--world {world}, but the launcher started {launched_world} processes; drop --world "
                                f"(under a launcher the world is the launcher's)")
        return launched_world
    if world is not None and world < 1:
        raise C.ConfigError(f"--world {world}: must be a positive integer")
    return world or DEFAULT_WORLD


def fixed_axes(cfg: C.Config) -> dict:
    """The searched axes the user gave (flag or TOML): they stay as given."""
    return {name: getattr(cfg.layout, name) for section, name in cfg.given
            if section == "layout" and name in SEARCHED}


def plan_search(cfg: C.Config, launched_world: int | None, local_world: int | None, device_type: str,
                resuming: bool = False, restarted: bool = False) -> SearchPlan:
    """The candidates, or one line (ConfigError) saying why there are none. `local_world`: the
    ranks on this host (the CPU's memory is shared among them); `resuming` (--resume,
    --resume-from) trains the layout an earlier search of the run chose unless --reprofile
    asks for a new search; `restarted` (a restart of the job's ranks) always does."""
    from meshtrain.cli.workload import preset_workload
    from meshtrain.cli.validate import adopt_imported_model, adopt_prepared_data, validate
    from meshtrain.plan.planner import PlanError
    from meshtrain.recipe import is_user_model

    s = cfg.search
    if is_user_model(cfg.model.name):
        raise C.ConfigError(f"--layout-search ranks layouts with the planner, which models the presets; --model "
                            f"{cfg.model.name} is your own: give its layout flags, or search in Python with "
                            f"meshtrain.search_layout(..., shape=A_PRESET_OF_ITS_SHAPE)")
    world = world_of(cfg, launched_world)
    adopt_imported_model(cfg)
    adopt_prepared_data(cfg)
    previous = _resumed_record(cfg, world) if restarted or (resuming and not s.reprofile) else None
    if previous is not None:
        return previous
    try:
        work = replace(preset_workload(cfg), device=device_type)
    except PlanError as e:
        raise C.ConfigError(str(e)) from None

    refusals = []

    def accepted(lay: Layout) -> Layout | None:
        trial = copy.deepcopy(cfg)
        trial.layout = replace(lay)
        try:
            validate(trial, world_size=world)  # the planner's rules are train's, less some of a model's own
        except C.ConfigError as e:
            refusals.append(str(e))
            return None
        return trial.layout
    fixed = fixed_axes(cfg)
    request = Request(cfg.model.name, work, world, local_world or world, replace(cfg.layout, dp=None), fixed,
                      s.candidates, s.memory_per_rank, s.budget, s.machine, device_type, flags=True,
                      mem_headroom=s.mem_headroom)
    if s.machine is None and device_type == "cpu" and not host_profile_path().is_file():
        if launched_world is not None:  # every rank would measure
            raise C.ConfigError("--layout-search on the CPU under a launcher needs a machine profile: make one with "
                                "`meshtrain plan --calibrate --machine FILE` and pass --machine FILE")
        _calibrate_host(str(host_profile_path()), world)
    try:
        return propose(request, accepted, search_key(cfg, world, machine_name(s.machine, device_type)),
                       reprofile=s.reprofile)
    except SearchRefused as e:
        if refusals and len(set(refusals)) == 1 and "is one the trainer accepts" in str(e):
            raise C.ConfigError(refusals[0]) from None  # every layout failed alike: a flag's own problem
        reason = f" (the fastest: {refusals[0]})" if refusals and "is one the trainer accepts" in str(e) else ""
        raise C.ConfigError(f"{e}{reason}") from None


def _calibrate_host(path: str, world: int) -> None:
    from meshtrain.cli.calibrate import calibrate, stderr_progress
    from meshtrain.cli.log import log

    log(f"--layout-search: measuring this machine for the planner (once; saved to {path})")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    calibrate(ranks=max(1, min(world, os.cpu_count() or 1)), budget_s=30.0, progress=stderr_progress,
              device="cpu").save(path)


def search_key(cfg: C.Config, world: int, machine: str) -> str:
    """What a profile's measurements depend on: the model, batch and data, the layout options
    that are not searched, the axes fixed, the world, and the machine (host, device, torch)."""
    searched = set(SEARCHED) | {"stage_layers"}
    return key_of({"model": cfg.to_dict()["model"], "data": cfg.train.data, "batch": cfg.train.batch_size,
                   "seq": cfg.train.seq_len, "vocab": cfg.train.vocab_size, "world": world, "fixed": fixed_axes(cfg),
                   "layout": {k: v for k, v in cfg.to_dict()["layout"].items() if k not in searched},
                   "machine": machine})


def _resumed_record(cfg: C.Config, world: int) -> SearchPlan | None:
    """The search a resumed (or restarted) run made when it began, when OUT has it for this world."""
    path = Path(cfg.train.out) / RESULT_FILE
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if rec.get("world") != world or rec.get("chosen") is None:
        return None
    plan = plan_from_record(rec)
    for c in plan.candidates:  # the searched axes as recorded, every other option as given now
        c.layout = replace(cfg.layout, **{k: getattr(c.layout, k) for k in SEARCHED})
    plan.resumed, plan.profile_s = True, 0.0
    plan.notes.append(f"resumed: the layout this run's search chose ({path}); --reprofile searches again")
    return plan


def config_trial(cfg: C.Config):
    """The command line's candidate: its configuration with the candidate's layout, built
    by `train.setup` and stepped by `train.train_step` on the run's batches."""
    from meshtrain.comm import Comm
    from meshtrain.train import setup, train_step

    def build(layout, mesh):
        trial = copy.deepcopy(cfg)
        trial.layout = layout
        data, job = setup(trial, Comm(mesh), measure_memory=False)
        return job, lambda step, meter: train_step(job, data, step, trial, meter=meter)
    return build

"""`meshtrain verify`: the contract that every layout trains the same model as one process.

The layout and the one-process reference (every axis 1, one micro-batch, same seed and
global batch) each record their per-step losses and every parameter tensor at full shape
after the first step and after the last. The verdict is the largest relative difference
‖a − b‖ / ‖b‖ over every tensor (a bug that corrupts one weight's gradient hides in a global
norm, not here) and over the losses; it passes at ≤ 1e-4 in fp32."""

from __future__ import annotations

import copy
import json
import sys

import torch

from meshtrain.comm import Comm
from meshtrain.config import Config, LayoutConfig
from meshtrain.launch import local_device
from meshtrain.mesh import Mesh
from meshtrain.train import train

TOLERANCE = 1e-4


def reference_config(cfg: Config) -> Config:
    ref = copy.deepcopy(cfg)
    ref.layout = LayoutConfig(dp=1, tp=1, pp=1, microbatches=1)
    return ref


def record(cfg: Config, comm: Comm, label: str) -> dict | None:
    """Losses and full-shape parameters after step 1 and the last step (on rank 0)."""
    result = train(cfg, comm, snapshot_steps={1, cfg.train.steps}, progress=label)
    if not comm.mesh.is_main:
        return None
    return {"losses": result.losses, "snapshots": result.snapshots}


def record_reference(cfg: Config) -> dict:
    return record(reference_config(cfg), Comm(Mesh.single(local_device())), "reference")


def against_reference(cfg: Config, layout: dict, json_mode: bool) -> int:
    """Run the one-process reference here, compare, report; returns the exit code."""
    return report(cfg, compare(layout, record_reference(cfg)), json_mode)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    denom = b.norm().item()
    diff = (a - b).norm().item()
    return diff / denom if denom > 0 else diff


def compare(layout: dict, reference: dict) -> dict:
    loss_diffs = [abs(a - b) / abs(b) if b else abs(a - b) for a, b in zip(layout["losses"], reference["losses"])]
    worst, worst_where = 0.0, None
    for step, ref_state in reference["snapshots"].items():
        state = layout["snapshots"][step]
        if state.keys() != ref_state.keys():
            raise RuntimeError(f"parameter names differ after step {step}: "
                               f"{sorted(set(state) ^ set(ref_state))[:5]}")
        for name, ref_t in ref_state.items():
            if state[name].shape != ref_t.shape:
                raise RuntimeError(f"{name}: shape {tuple(state[name].shape)} != {tuple(ref_t.shape)}")
            d = _rel(state[name], ref_t)
            if d >= worst:
                worst, worst_where = d, f"{name} after step {step}"
    max_loss = max(loss_diffs)
    return {"losses": {"layout": layout["losses"], "reference": reference["losses"]},
            "loss_rel_diffs": loss_diffs, "max_loss_rel_diff": max_loss, "max_param_rel_diff": worst,
            "worst_param": worst_where, "tolerance": TOLERANCE,
            "passed": max_loss <= TOLERANCE and worst <= TOLERANCE}


def report(cfg: Config, result: dict, json_mode: bool) -> int:
    """Print the side-by-side losses and the verdict; returns the exit code."""
    out = sys.stderr if json_mode else sys.stdout
    print(f"{'step':>5}  {'layout':>12}  {'reference':>12}  {'rel diff':>9}", file=out)
    losses = result["losses"]
    for i, (a, b, d) in enumerate(zip(losses["layout"], losses["reference"], result["loss_rel_diffs"])):
        print(f"{i + 1:>5}  {a:>12.8f}  {b:>12.8f}  {d:>9.2e}", file=out)
    verdict = "PASS" if result["passed"] else "FAIL"
    print(f"max_loss_rel_diff {result['max_loss_rel_diff']:.2e}  max_param_rel_diff "
          f"{result['max_param_rel_diff']:.2e} (largest: {result['worst_param']})", file=out)
    print(f"{verdict}: {cfg.model.name} with {cfg.layout.short()} vs one process, {cfg.train.steps} steps, "
          f"tolerance {TOLERANCE:g}", file=out)
    if json_mode:
        keys = ("max_loss_rel_diff", "max_param_rel_diff", "worst_param", "tolerance", "passed", "losses")
        print(json.dumps({"steps": cfg.train.steps, "layout": cfg.layout.summary(),
                          **{k: result[k] for k in keys}}), flush=True)
    return 0 if result["passed"] else 1

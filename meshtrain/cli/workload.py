"""The planner's workload of a configured preset or published architecture: its shape, the
global batch and the sequence length (`plan` and `train --layout-search` alike)."""

from __future__ import annotations

import meshtrain.cli.config as C
from meshtrain.plan.planner import PlanError, Workload
from meshtrain.plan.shapes import Shape
from meshtrain.recipes import family_of, is_preset, is_published, shape_of


def preset_workload(cfg: C.Config, seq_given: bool = True) -> Workload:
    """The configured preset (or published shape) and batch as the planner's workload; a
    published shape keeps its own context length unless `seq_given`."""
    tr = cfg.train
    try:
        shape = shape_of(cfg.model.name, tr.vocab_size)
        if cfg.model.moe_options() and is_preset(cfg.model.name):  # --moe-* flags: the spec they make
            spec = cfg.model.spec()
            shape = family_of(spec).shape(spec, tr.vocab_size)
    except ValueError as e:
        raise PlanError(str(e)) from None
    seq = shape.seq_len if (is_published(cfg.model.name) and not seq_given) else tr.seq_len
    if (shape.kind == "gpt" or cfg.model.init_from) and seq > shape.seq_len:
        raise PlanError(f"--seq-len {seq} exceeds the {shape.seq_len} positions of {cfg.model.name}")
    return checked_workload(cfg, shape, seq)


def checked_workload(cfg: C.Config, shape: Shape, seq: int) -> Workload:
    if cfg.train.batch_size < 1 or seq < 1:
        raise PlanError("--batch-size and --seq-len must be positive integers")
    if not 0 <= cfg.model.dropout < 1:
        raise PlanError(f"--dropout {cfg.model.dropout}: use a probability in [0, 1)")
    return Workload(shape, cfg.train.batch_size, seq, cfg.model.dropout, cfg.model.attention,
                    optimizer=cfg.train.optimizer)

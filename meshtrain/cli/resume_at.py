"""`verify --resume-at K [--resume-layout L]`: the configuration the run resumes in after
step K, from the first part's (`resumed_config`). L is a layout written as its flags
without dashes (`parallel.options.parse_layout`, the grammar `meshtrain.verify` reads too).

No torch import here: both layouts are refused or accepted before any rank starts."""

from __future__ import annotations

import dataclasses

from meshtrain.cli.config import Config, ConfigError, LayoutConfig
from meshtrain.cli.validate import validate
from meshtrain.parallel.options import parse_layout


# What --resume-layout inherits from the first layout: verify's one-process reference trains
# in one precision, and with one fp8 conversion, throughout, so both parts must train so (a
# plain resume may change them).
RESUME_KEEPS = ("precision", "fp8", "fp8_emulate", "fp8_min_features")


def resumed_config(cfg: Config, world_size: int | None = None) -> Config | None:
    """`verify --resume-at K [--resume-layout L]`: the configuration the run resumes in after
    step K (None without --resume-at), validated; `cfg` is the first part's, validated. L's
    keys not named take their defaults, as on a command line — but for `RESUME_KEEPS`, which
    the reference holds equal and so come from the first layout — and an unset dp fills the
    first layout's world where tp·pp·cp divides it (else 1). From a shell meshtrain starts each
    part's own ranks, so the worlds may differ; under a launcher (`world_size`) the resumed
    part runs in the same processes, so L must fill that world."""
    tr = cfg.train
    if tr.resume_at is None:
        if tr.resume_layout:
            raise ConfigError("--resume-layout names the layout a resume continues in; give --resume-at K too")
        return None
    if not 1 <= tr.resume_at < tr.steps:
        raise ConfigError(f"--resume-at {tr.resume_at}: save after a step from 1 to {tr.steps - 1} (--steps "
                          f"{tr.steps}), so that steps are left to run resumed")
    if tr.resume or tr.resume_from or tr.save_every:
        raise ConfigError("verify --resume-at saves and resumes by itself, in a temporary folder; drop --resume, "
                          "--resume-from and --save-every")
    second = Config(model=dataclasses.replace(cfg.model), layout=dataclasses.replace(cfg.layout),
                    train=dataclasses.replace(cfg.train))
    if tr.resume_layout is not None:
        kept = {name: getattr(cfg.layout, name) for name in RESUME_KEEPS}
        second.layout = LayoutConfig(**{**kept, **parse_layout(tr.resume_layout)})
    lay, where = second.layout, f"--resume-layout {tr.resume_layout!r}"
    world, rest = world_size or cfg.layout.world_size, lay.tp * lay.pp * lay.cp
    if lay.dp is None:
        lay.dp = world // rest if world % rest == 0 else 1
    if world_size is not None and lay.world_size != world_size:
        raise ConfigError(f"{where}: dp×cp×tp×pp = {lay.dp}×{lay.cp}×{lay.tp}×{lay.pp} = {lay.world_size}, but the "
                          f"launcher started {world_size} processes; under a launcher the run resumes in the same "
                          f"processes, so give a layout of {world_size} ranks (from a shell meshtrain starts each "
                          f"part's own)")
    if lay.precision != cfg.layout.precision:
        raise ConfigError(f"{where}: precision {lay.precision}, but the run saved in {cfg.layout.precision}; "
                          f"write precision={cfg.layout.precision} there")
    first = cfg.layout
    if (lay.fp8, lay.fp8_min_features) != (first.fp8, first.fp8_min_features):
        raise ConfigError(f"{where}: fp8={lay.fp8} fp8-min-features={lay.fp8_min_features}, but the run saved with "
                          f"fp8={first.fp8} fp8-min-features={first.fp8_min_features}; the reference keeps one "
                          f"conversion throughout: drop them there")
    if lay.fp8 != "none" and lay.dp * lay.microbatches != first.dp * first.microbatches:
        raise ConfigError(f"{where}: dp×microbatches = {lay.dp}×{lay.microbatches}, but the run saved in "
                          f"{first.dp}×{first.microbatches}; fp8's scales are each micro-batch's, and the reference "
                          f"runs the first layout's micro-batches throughout: keep dp×microbatches = "
                          f"{first.dp * first.microbatches}")
    try:
        validate(second, world_size)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    return second

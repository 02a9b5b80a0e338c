"""The strategies, one module each, and `compose`, which applies them to a plain model in
one fixed order (`parallelize`, re-exported here).

Importing the package imports nothing else, torch included: the pipeline's schedules are
pure data (`pipeline.schedules`, `pipeline.simulate`) that the planner and `meshtrain
schedule` use without loading torch (~2 s). `parallelize`, `Parallelized` and `GradSyncs`
are loaded from `compose` on first use."""

_COMPOSE = ("GradSyncs", "Parallelized", "parallelize")


def __getattr__(name: str):
    if name in _COMPOSE:
        from meshtrain.parallel import compose
        return getattr(compose, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

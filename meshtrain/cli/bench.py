"""`meshtrain bench --vs PEER`'s part in the ranks: the command line's configuration turned
into the typed options `meshtrain.bench` takes."""

from __future__ import annotations

import meshtrain.cli.config as C
from meshtrain.recipes import pipeline_plan_of


def bench_options(cfg: C.Config, peer: str):
    """What the peer is built from, and the train loop's pieces ours and the peer run in
    (`train.setup`, `job_for`, `train_step`)."""
    from meshtrain import bench, train

    tr = cfg.train
    peer_options = bench.PeerOptions(layout=cfg.layout, build_model=lambda device: train.build(cfg, device)[1],
                                     lr=tr.lr, weight_decay=tr.weight_decay,
                                     pipeline=pipeline_plan_of(cfg.model.spec()) if peer == "torch-pp" else None)
    return bench.BenchOptions(peer=peer_options, ours=lambda comm: train.setup(cfg, comm),
                              as_job=lambda p: train.job_for(p, cfg),
                              step=lambda job, data, i: train.train_step(job, data, i, cfg), steps=tr.steps,
                              model=cfg.model.name)


def run(cfg: C.Config, comm, args):
    """Collective: both set-ups interleaved in these ranks; rank 0 reports after shutdown."""
    from meshtrain import bench

    options = bench_options(cfg, args.vs)
    result = bench.run_bench(options, comm, args.vs)
    if not comm.mesh.is_main:
        return lambda: 0
    return lambda: bench.report(options, result, args.json)

"""`meshtrain train | verify | bench | generate` (the contract in DESIGN.md).

From a plain shell a multi-rank command validates its configuration, prepares the data,
and starts dp×tp×pp local ranks through torchrun's engine; each rank runs this same command
line and finds itself under a launcher, as it does under torchrun, srun or mpirun."""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
from pathlib import Path

from meshtrain import config as C
from meshtrain import launch

BENCH_PEERS = ("ddp",)  # meshtrain.bench.PEERS, named here so that a bad --vs fails without torch
VERIFY_STEPS = 10
BENCH_STEPS = 20
LAYOUT_DUMP = "layout.pt"


def _add_run_flags(p: argparse.ArgumentParser, steps: int | None = None) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML file with [model], [layout], [train] sections")
    defaults = C.Config()
    defaults.train.steps = steps or defaults.train.steps
    for flag, section, name, typ, help_text in C.FLAGS:
        if typ is bool:
            p.add_argument(flag, action="store_true", default=None, help=help_text)
        else:
            default = getattr(getattr(defaults, section), name)
            p.add_argument(flag, type=typ, default=None, help=f"{help_text} (default {default})",
                           metavar=typ.__name__.upper())
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshtrain", description="Distributed training, every strategy, "
                                "verified against one process.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    launched = ("From a shell, starts dp×tp×pp local ranks itself; under torchrun, srun or mpirun "
                "it joins the ranks those started.")
    train = sub.add_parser("train", help="train a model (default: gpt-small on Shakespeare, dp=2)",
                           description="Train a model. " + launched)
    _add_run_flags(train)
    verify = sub.add_parser("verify", help=f"check a layout against one process (default {VERIFY_STEPS} steps)",
                            description="Run the layout and one-process training on the same seed and global "
                            "batch; exit 0 only if losses and every parameter agree to 1e-4. " + launched)
    _add_run_flags(verify, steps=VERIFY_STEPS)
    verify.add_argument("--dump-dir", help=argparse.SUPPRESS)  # set by the launching parent
    bench = sub.add_parser("bench", help=f"ours vs PyTorch's native peer, interleaved (default {BENCH_STEPS} steps)",
                           description="Run this project and PyTorch's native peer step by step in the same "
                           "ranks; report median step times and their ratio. " + launched)
    _add_run_flags(bench, steps=BENCH_STEPS)
    bench.add_argument("--vs", required=True, metavar="PEER", help="the peer: ddp")
    gen = sub.add_parser("generate", help="sample text from a model trained by `meshtrain train`")
    gen.add_argument("--ckpt", required=True, metavar="DIR", help="the --out folder of a training run")
    gen.add_argument("--prompt", default="\n", help="text to continue")
    gen.add_argument("--tokens", type=int, default=200, help="tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--top-k", type=int, default=50)
    gen.add_argument("--seed", type=int, default=0)
    return p


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _config_from(args) -> C.Config:
    given = {(sec, name): getattr(args, _dest(flag)) for flag, sec, name, _, _ in C.FLAGS}
    overrides = {key: value for key, value in given.items() if value is not None}
    if args.command == "verify":
        overrides.setdefault(("train", "steps"), VERIFY_STEPS)
    if args.command == "bench":
        overrides.setdefault(("train", "steps"), BENCH_STEPS)
    return C.load(args.config, overrides)


def _check_command(cfg: C.Config, args) -> None:
    if args.command == "bench":
        if args.vs not in BENCH_PEERS:
            raise C.ConfigError(f"unknown peer '{args.vs}'; use --vs {' | '.join(BENCH_PEERS)}")
        if cfg.layout.dp < 2:
            raise C.ConfigError("bench --vs ddp compares data parallelism; use --dp 2 or more")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        return _generate(args)
    from meshtrain.data.corpus import DataError

    renv = launch.detect()
    try:
        cfg = _config_from(args)
        C.validate(cfg, world_size=renv.world_size if renv else None)
        _check_command(cfg, args)
        if renv is None:  # prepare the data once, before any rank starts
            _prepare_data(cfg)
    except (C.ConfigError, DataError) as e:
        if renv is None:
            print(f"meshtrain: error: {e}", file=sys.stderr)
            return 2
        # Every rank says it: the launcher may stop the others as soon as the first one exits.
        print(f"meshtrain: error (rank {renv.rank}): {e}", file=sys.stderr)
        return launch.finish(2)

    if renv is None and cfg.layout.world_size > 1:
        return _launch_local(cfg, args, argv)
    try:
        return _run_here(cfg, args, renv)
    except KeyboardInterrupt:  # Ctrl-C reaches every rank: leave quietly, the launcher reports it
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        return launch.finish(130) if renv else 130


def _log(msg: str) -> None:
    print(f"meshtrain: {msg}", file=sys.stderr, flush=True)


def _prepare_data(cfg: C.Config) -> None:
    from meshtrain.data.datasets import prepare
    prepare(cfg.train.data, cfg.model.name, cfg.train.vocab_size, cfg.train.seq_len, log=_log)


def _launch_local(cfg: C.Config, args, argv: list[str]) -> int:
    """Start the ranks; for verify, then run the one-process reference here and compare."""
    n = cfg.layout.world_size
    _log(f"starting {n} local ranks (dp={cfg.layout.dp}, tp={cfg.layout.tp}, pp={cfg.layout.pp})")
    if args.command != "verify":
        return launch.spawn(n, argv)
    import torch

    from meshtrain import verify
    with tempfile.TemporaryDirectory(prefix="meshtrain-verify-") as tmp:
        code = launch.spawn(n, argv + ["--dump-dir", tmp])
        if code:
            return code
        layout = torch.load(Path(tmp, LAYOUT_DUMP), weights_only=False)
    return verify.against_reference(cfg, layout, args.json)


def _run_here(cfg: C.Config, args, renv) -> int:
    """This process is a rank (under a launcher), or the whole job (world size 1)."""
    from meshtrain.comm import Comm
    from meshtrain.mesh import Mesh

    if renv is None:
        mesh = Mesh.single(launch.local_device())
    else:
        import torch.distributed as dist
        device = launch.init_distributed(renv)
        if renv.local_rank == 0:
            _prepare_data(cfg)
        mesh = Mesh.build(cfg.layout.pp, cfg.layout.dp, cfg.layout.tp, device)
        dist.barrier()  # the data is ready
    comm = Comm(mesh)
    if args.command == "verify":
        code = _verify(cfg, comm, args, renv)
    else:
        code = _COMMANDS[args.command](cfg, comm, args)
        if renv is not None:
            launch.shutdown_distributed()
    return launch.finish(code) if renv is not None else code


def _train(cfg, comm, args) -> int:
    from meshtrain.metrics import StepLog
    from meshtrain.report import finish_training
    from meshtrain.train import train

    log = StepLog(Path(cfg.train.out) / "metrics.jsonl") if comm.mesh.is_main else None
    result = train(cfg, comm, progress="train", step_log=log)
    if log:
        log.close()
    finish_training(cfg, comm, result, args.json)
    return 0


def _verify(cfg, comm, args, renv) -> int:
    """The layout's run, then on rank 0: hand the record to our launching parent (which runs
    the reference), or — under torchrun/srun/mpirun or alone — run the reference here."""
    import torch

    from meshtrain import verify

    rec = verify.record(cfg, comm, "layout")
    if renv is not None:
        launch.shutdown_distributed()
    if not comm.mesh.is_main:
        return 0
    if args.dump_dir:
        torch.save(rec, Path(args.dump_dir, LAYOUT_DUMP))
        return 0
    return verify.against_reference(cfg, rec, args.json)


def _bench(cfg, comm, args) -> int:
    from meshtrain.bench import run_bench
    return run_bench(cfg, comm, args.vs, args.json)


_COMMANDS = {"train": _train, "bench": _bench}


def _generate(args) -> int:
    from meshtrain.checkpoint import load_model
    from meshtrain.generate import sample

    try:
        model, tokenizer, cfg = load_model(Path(args.ckpt), launch.local_device())
    except (FileNotFoundError, ValueError) as e:
        print(f"meshtrain: error: {e}", file=sys.stderr)
        return 2
    prompt = list(tokenizer.encode(args.prompt))
    ids = sample(model, prompt, args.tokens, cfg.train.seq_len, temperature=args.temperature,
                 top_k=args.top_k, seed=args.seed)
    print(args.prompt + tokenizer.decode(ids))
    return 0

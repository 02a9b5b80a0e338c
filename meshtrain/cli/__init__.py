"""`meshtrain train | verify | bench | schedule | plan | prepare | export | generate` (the
contract in DESIGN.md).

From a plain shell a multi-rank command validates its configuration, prepares the data,
and starts dp×tp×pp local ranks through torchrun's engine; each rank runs this same command
line and finds itself under a launcher, as it does under torchrun, srun or mpirun.

Each command has a collective part, which every rank runs inside the process group, and a
part for rank 0 alone (writing files, the verify reference, printing), which runs after the
group is shut down: nothing slow ever holds the other ranks inside a timed collective.

What a command imports inside its own function loads torch (or that command's machinery:
the planner's flags, the trainer, DCP) only when it runs, so that a bad flag is refused, and
`--help` and `plan` answer, in a fraction of a second."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
from pathlib import Path

from meshtrain import config as C
from meshtrain.recipe import is_user_model
from meshtrain import launch
from meshtrain.recipes import PUBLISHED, family_of, pipeline_plan_of
from meshtrain.checkpoint.folders import COMPLETE, steps_in_local
from meshtrain.checkpoint.owner import OwnerError, RUN_ID_ENV, read_run
from meshtrain.data.corpus import DataError
from meshtrain.checkpoint.lock import OutLock, OutLocked
from meshtrain import board, faults
from meshtrain.checkpoint import lineage, owner
from meshtrain.parallel.pipeline.draw import draw_panels, draw_png, summary, text_timeline
from meshtrain.parallel.pipeline.schedules import schedule
from meshtrain.parallel.pipeline.simulate import simulate
from meshtrain.hf import SIDE_FILES, TOKENIZER

BENCH_PEERS = ("ddp", "zero1", "fsdp2", "dtensor-tp", "torch-pp")  # meshtrain.bench.PEERS, named here so a bad --vs fails without torch
COMMAND_STEPS = {"verify": 10, "bench": 20}  # their default --steps, unless TOML or a flag says
LAYOUT_DUMP = "layout.pt"


class _Parser(argparse.ArgumentParser):
    """argparse's errors as every other refusal: one line, exit 2 — not the page of usage
    argparse prints first, which buries the line that says what is wrong. Subcommands'
    parsers are of this class too (`add_subparsers` makes its parent's)."""

    def error(self, message: str):
        self.exit(2, f"meshtrain: error: {message} (see {self.prog} --help)\n")


def _add_run_flags(p: argparse.ArgumentParser, steps: int | None = None) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML file with [model], [layout], [train] sections")
    defaults = C.Config()
    defaults.train.steps = steps or defaults.train.steps
    for flag, section, name, typ, help_text in C.FLAGS:
        if typ is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                           help=f"{help_text} (default off)")
        else:
            default = getattr(getattr(defaults, section), name)
            # an empty default ("": the preset's) or one the text already states is not shown twice
            shown = f" (default {default})" if default not in (None, "") and "(default" not in help_text else ""
            p.add_argument(flag, type=typ, default=None, help=f"{help_text}{shown}", metavar=typ.__name__.upper())
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def build_parser(plan_flags: bool = True) -> argparse.ArgumentParser:
    """The command line. `plan_flags`: also `plan`'s own flags, which import the planner and
    with it torch (~2 s): `main` asks for them only when the command is `plan`, so that
    every other command's bad input is refused at once."""
    p = _Parser(prog="meshtrain", description="Distributed training, every strategy, verified against one process.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    launched = ("From a shell, starts dp×tp×pp local ranks itself; under torchrun, srun or mpirun "
                "it joins the ranks those started.")
    train = sub.add_parser("train", help="train a model (default: gpt-small on Shakespeare, dp=2)",
                           description="Train a model. " + launched)
    _add_run_flags(train)
    train.add_argument("--trace", metavar="FILE", help="pipeline: also write when each stage ran each forward and "
                       "backward, every step, to FILE (JSON; compare with `meshtrain schedule --trace FILE`)")
    steps = COMMAND_STEPS["verify"]
    verify = sub.add_parser("verify", help=f"check a layout against one process (default {steps} steps)",
                            description="Run the layout and one-process training on the same seed and global "
                            "batch. At the first, a middle and the last step the reference takes the step from "
                            "the layout's own state: gradients, updates and the loss must agree per tensor, "
                            "and every rank's copy must match. Exit 0 only then. " + launched)
    _add_run_flags(verify, steps=steps)
    verify.add_argument("--dump-dir", help=argparse.SUPPRESS)  # set by the launching parent
    # --resume-at from a shell: which part these ranks run (`verifier.FIRST` or `RESUMED`), set by the parent
    verify.add_argument("--verify-part", help=argparse.SUPPRESS)
    steps = COMMAND_STEPS["bench"]
    bench = sub.add_parser("bench", help=f"ours vs PyTorch's native peer, interleaved (default {steps} steps)",
                           description="Run this project and PyTorch's native peer step by step in the same "
                           "ranks; report median step times and their ratio. " + launched)
    _add_run_flags(bench, steps=steps)
    bench.add_argument("--vs", required=True, metavar="PEER", help="the peer: " + " | ".join(BENCH_PEERS))
    sched = sub.add_parser("schedule", help="a pipeline schedule's timeline, bubble and memory, simulated",
                           description="Simulate a pipeline schedule (forward 1, backward 2, or 1 + 1 when split; "
                           "transfers free) and show its timeline per stage, bubble fraction and peak of "
                           "micro-batches in flight. Starts no processes.")
    sched.add_argument("--pp", type=int, metavar="P", help="pipeline stages")
    sched.add_argument("--microbatches", type=int, metavar="M", help="micro-batches per step")
    sched.add_argument("--schedule", default="1f1b", metavar="NAME", help="gpipe | 1f1b | interleaved | zb "
                       "(default 1f1b)")
    sched.add_argument("--chunks", type=int, default=1, metavar="V", help="model chunks per stage (interleaved; "
                       "default 1)")
    sched.add_argument("--trace", metavar="FILE", help="instead: simulate a real run traced by `meshtrain train "
                       "--trace FILE` with its measured costs and compare the two")
    sched.add_argument("--png", metavar="FILE", help="also draw the timeline into FILE")
    sched.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    plan = sub.add_parser("plan", help="memory per device and step time of a layout, or the best layouts (no processes)",
                          description="Predict memory per device (model states, activations), FLOPs, traffic, "
                          "pipeline bubble, step time and MFU of a model on a cluster, for one layout or searched "
                          "over all of them (--search). Takes train's flags; --model also names the published "
                          f"architectures: {', '.join(PUBLISHED)}.")
    _add_run_flags(plan)
    if plan_flags:
        from meshtrain.cli.plan import add_arguments as add_plan_arguments
        add_plan_arguments(plan)
    exp = sub.add_parser("export", help="a sharded checkpoint of any layout as the one-process model's safetensors",
                         description="Assemble the weights of a sharded checkpoint (a step-N folder, written in any "
                         "layout) at full shape, without starting ranks, and write them as safetensors files of at "
                         "most --max-shard-gb each (with model.safetensors.index.json when there are several), "
                         "beside the run's configuration and tokenizer: `meshtrain generate --ckpt OUT` reads it. "
                         "With --hf, a folder transformers loads as is (config.json with the special-token ids, "
                         "generation_config.json, the tokenizer and its tokenizer_config.json), written one tensor at "
                         "a time; `generate --ckpt OUT` reads that too.")
    exp.add_argument("--ckpt", required=True, metavar="DIR", help="a checkpoint folder (OUT/step-N)")
    exp.add_argument("--out", required=True, metavar="DIR", help="where to write the weights: a new or empty folder "
                     "(never a training run's --out, the --ckpt or the run's --init-from folder)")
    exp.add_argument("--overwrite", action="store_true", help="export into a non-empty --out: its files are moved "
                     "aside into OUT/replaced-<time>/ (renamed, not deleted)")
    exp.add_argument("--max-shard-gb", type=float, default=2.0, help="largest weight file, in GB (default 2)")
    exp.add_argument("--hf", action="store_true", help="a folder transformers loads (Llama, and the MoE as Mixtral, Qwen3-MoE "
                     "or OLMoE); "
                     "--ckpt may then also be a run's --out or a plain export")
    exp.add_argument("--dtype", default=None, help="bf16|fp32: the weights' dtype (default: with --hf the run's "
                     "--precision, else the saved fp32 master weights)")
    gen = sub.add_parser("generate", help="sample text from a model trained by `meshtrain train`")
    gen.add_argument("--ckpt", required=True, metavar="DIR", help="the --out folder of a training run, one of its "
                     "checkpoints (OUT/step-N), or an exported folder (`export`'s, or `export --hf`'s)")
    gen.add_argument("--prompt", default="\n", help="text to continue")
    gen.add_argument("--tokens", type=int, default=200, help="tokens to generate (default 200)")
    gen.add_argument("--temperature", type=float, default=0.8, help="softmax temperature > 0 (default 0.8)")
    gen.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest; 0: all (default 50)")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    gen.add_argument("--device", default="auto", help="auto|cpu|cuda (default auto)")
    _add_prepare_parser(sub)
    return p


def _add_prepare_parser(sub) -> None:
    prep = sub.add_parser("prepare", help="tokenize text once into the token folder `train --data DIR` reads",
                          description="Tokenize text (a file, a folder of files, .jsonl files with a \"text\" field "
                          "per line, Parquet files with a \"text\" column, or 'shakespeare') into a new folder of "
                          "token files that `meshtrain train --data DIR` reads and numpy opens (docs/data.md): with "
                          "--init-from, the Hugging Face folder's tokenizer.json applied to each whole document as "
                          "`tokenizers` encodes it, then its EOS; else a BPE of --vocab-size tokens trained on the "
                          "text (256: bytes). Documents are streamed and encoded by --workers processes: memory "
                          "does not grow with the corpus, and the ids are the same whatever --workers.")
    prep.add_argument("--data", required=True, metavar="PATH", help="the text: a file, a folder, or 'shakespeare'")
    prep.add_argument("--init-from", metavar="DIR", help="a Hugging Face folder: its tokenizer.json, and the EOS its "
                      "tokenizer_config.json (else config.json) names")
    prep.add_argument("--vocab-size", type=int, metavar="N", help="without --init-from: the vocabulary of the BPE "
                      f"trained on the text (256: the byte tokenizer; default {C.TrainConfig.vocab_size})")
    prep.add_argument("--out", required=True, metavar="DIR", help="the new token folder (absent or empty)")
    prep.add_argument("--workers", type=int, metavar="N", help="processes that tokenize (1: in this one; default: "
                      "the cores this process may use)")
    prep.add_argument("--text-field", default="text", metavar="NAME", help="the field of a .jsonl line, or the "
                      "column of a Parquet file, that holds the text (default: text)")


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _config_from(args) -> C.Config:
    given = {(sec, name): getattr(args, _dest(flag)) for flag, sec, name, _, _ in C.FLAGS}
    overrides = {key: value for key, value in given.items() if value is not None}
    defaults = {("train", "steps"): COMMAND_STEPS[args.command]} if args.command in COMMAND_STEPS else {}
    cfg = C.load(args.config, overrides, defaults)
    if getattr(args, "verify_part", None):  # a rank of one part of `verify --resume-at`, started by the parent
        from meshtrain import verifier
        C.validate(cfg)  # as the parent did, from its shell
        cfg = verifier.part_config(cfg, C.resumed_config(cfg), args.verify_part, Path(args.dump_dir))
    return cfg


def _check_command(cfg: C.Config, args) -> None:
    if args.command == "verify" and not getattr(args, "verify_part", None):  # both layouts, before any rank starts
        renv = launch.detect()
        C.resumed_config(cfg, renv.world_size if renv else None)
    elif args.command != "verify" and (cfg.train.resume_at is not None or cfg.train.resume_layout):
        raise C.ConfigError("--resume-at and --resume-layout are verify's (a resume checked against one process); "
                            "train resumes with --resume or --resume-from")
    if args.command == "bench" and is_user_model(cfg.model.name):
        raise C.ConfigError(f"bench compares the presets with their PyTorch peers; --model {cfg.model.name} is your "
                            f"own: use train or verify")
    if args.command == "train" and args.trace and cfg.layout.pp < 2:
        raise C.ConfigError(f"--trace records a pipeline's timeline; use --pp 2 or more (this run has pp={cfg.layout.pp})")
    if args.command == "bench":
        if cfg.layout.compile:
            raise C.ConfigError("bench --compile would time compiled blocks against an eager peer; bench eager against "
                                "eager, and time --compile with benchmarks/compile.py")
        if args.vs not in BENCH_PEERS:
            raise C.ConfigError(f"unknown peer '{args.vs}'; use --vs {' | '.join(BENCH_PEERS)}")
        lay = cfg.layout
        if args.vs == "ddp" and (lay.dp < 2 or lay.tp > 1 or lay.zero):
            raise C.ConfigError("bench --vs ddp compares data parallelism alone; use --dp 2 or more, --tp 1 and --zero 0")
        for peer, stage in (("zero1", 1), ("fsdp2", 3)):
            if args.vs == peer and (lay.dp < 2 or lay.tp > 1 or lay.pp > 1 or lay.zero != stage):
                raise C.ConfigError(f"bench --vs {peer} compares ZeRO-{stage} alone; use --zero {stage}, --dp 2 or more, "
                                    "--tp 1 and --pp 1")
        if args.vs == "dtensor-tp" and (lay.tp < 2 or lay.dp > 1 or cfg.model.name == "mlp" or cfg.model.dropout):
            raise C.ConfigError("bench --vs dtensor-tp compares tensor parallelism of a GPT alone, without dropout; "
                                "use --tp 2 or more, --dp 1 and --dropout 0")
        if lay.precision != "fp32" and args.vs not in ("ddp", "fsdp2"):
            raise C.ConfigError(f"bench --vs {args.vs} runs in fp32 only (its peer has no bf16 mode with fp32 master "
                                "weights here); use --precision fp32, or --vs ddp | fsdp2 for bf16")
        if args.vs == "torch-pp" and (lay.pp < 2 or lay.dp > 1 or lay.tp > 1 or cfg.model.name == "mlp"):
            raise C.ConfigError("bench --vs torch-pp compares pipeline parallelism of a GPT alone; use --pp 2 or more, "
                                "--dp 1 and --tp 1")


def _check_build_fits_the_host(cfg: C.Config, local_ranks: int) -> None:
    """Each rank draws only its part of the model (`parallel.materialize`): 1/(tp·pp) of the
    parameters, 1/(tp·pp·dp) under ZeRO-3, in fp32 at least while drawing — so the host needs
    4 bytes a parameter of each local rank's part (a lower bound: gradients and moments come
    on top). A model that cannot fit is refused here, not by the kernel's OOM killer mid-build."""
    if is_user_model(cfg.model.name):
        return  # built whole on every rank, by the user's code: nothing to estimate from flags
    spec = cfg.model.spec()
    family = family_of(spec)
    n_params = family.n_params(spec, cfg.train.vocab_size)
    if n_params is None:
        return
    lay = cfg.layout
    part = n_params / (lay.tp * lay.pp * (lay.dp if lay.zero == 3 else 1))
    need, have = 4 * part * local_ranks, _available_host_bytes()
    if have is not None and need > have:
        what = f"--mlp-hidden {cfg.model.mlp_hidden}" if cfg.model.mlp_hidden else f"--model {cfg.model.name}"
        raise C.ConfigError(f"{what}: building its part takes 4 bytes × {part / 1e9:.2f} B parameters on each of "
                            f"{local_ranks} local rank(s), {need / 2**30:.1f} GiB; this host has {have / 2**30:.1f} GiB "
                            f"available; use a smaller model, more sharding (--tp, --pp, --zero 3) or fewer ranks "
                            f"per host")


def _available_host_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _restart_point(tr: C.TrainConfig) -> str:
    """Where a restart of this job resumes, as its ranks will decide it (`lineage.resume_plan`)."""
    run = os.environ.get(RUN_ID_ENV) or read_run(Path(tr.out)).get("run_id", "")
    return lineage.resume_plan(Path(tr.out), run, resume=tr.resume, resume_from=tr.resume_from, restarted=True,
                               job=lineage.job_id()).describe()


def _stopped_cleanly(out: str, since: float) -> str | None:
    """How the ranks stopped after a SIGTERM, when they all saved (`OUT/run.json`); else None."""
    stopped = read_run(Path(out)).get("stopped") or {}
    if stopped.get("by") == "SIGTERM" and stopped.get("at", 0) >= since:
        return f"stopped by SIGTERM after step {stopped['step']}; saved {stopped['saved']} (resume with --resume)"
    return None


def _check_resume_source(tr: C.TrainConfig) -> None:
    """--resume and --resume-from name a checkpoint that exists (whether it is good, the
    ranks decide together once started)."""
    if tr.resume_from and not (Path(tr.resume_from) / COMPLETE).is_file():
        what = "does not exist" if not Path(tr.resume_from).exists() else f"has no {COMPLETE} marker"
        raise C.ConfigError(f"--resume-from {tr.resume_from}: {what}; give a checkpoint folder (OUT/step-N, "
                            f"written by --save-every)")
    if tr.resume and not steps_in_local(Path(tr.out)):
        raise C.ConfigError(f"--resume: {tr.out} holds no checkpoint (step-N folders written with --save-every N); "
                            f"start without --resume, or name one with --resume-from")


def _check_out_writable(out: str) -> None:
    """Before any work: a run whose results cannot be saved is refused, not lost at the end."""
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".meshtrain-probe-"):
            pass
    except OSError as e:
        raise C.ConfigError(f"--out {out}: cannot write there ({e.strerror or e}); choose another folder") from None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(plan_flags=argv[:1] == ["plan"]).parse_args(argv)
    if args.command == "generate":
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `generate ... | head` ends quietly, as Unix tools do
        return _generate(args)
    if args.command == "schedule":
        return _schedule(args)
    if args.command == "prepare":
        return _prepare(args)
    if args.command == "export":
        return _export(args)
    if args.command == "plan":
        from meshtrain.cli.plan import run as plan
        try:
            cfg = _config_from(args)
        except C.ConfigError as e:
            print(f"meshtrain: error: {e}", file=sys.stderr)
            return 2
        return plan(args, cfg)


    renv, out_lock = None, None
    try:
        renv = launch.detect()
        ours = renv is not None and bool(os.environ.get(launch.LAUNCHER_PID_ENV))  # a rank meshtrain started
        if ours:
            launch.die_with_launcher()
        cfg = _config_from(args)
        C.validate(cfg, world_size=renv.world_size if renv else None)
        _check_command(cfg, args)
        speaks = renv.rank == 0 if renv else cfg.layout.world_size == 1  # rank 0 reports, once
        if args.command == "train" and (renv is None or renv.rank == 0):
            _check_out_writable(cfg.train.out)
        if args.command == "train":
            _check_resume_source(cfg.train)
            if cfg.train.tensorboard:
                if not board.available():
                    raise C.ConfigError(board.MISSING)
        for warning in C.warnings(cfg, args.command) if speaks else []:
            print(f"meshtrain: warning: {warning}", file=sys.stderr)
        if renv is not None and not ours and cfg.train.max_restarts and speaks:  # meshtrain's launcher restarts
            print("meshtrain: warning: under a launcher, restarts are the launcher's (torchrun --max-restarts N); "
                  "--max-restarts is ignored, and restarted ranks resume from the latest checkpoint by themselves",
                  file=sys.stderr)
        # From a shell the local ranks are all ours: check the GPUs before starting them.
        local_rank, local_world = (renv.local_rank, renv.local_world_size) if renv else (0, cfg.layout.world_size)
        device = launch.choose_device(cfg.train.device, local_rank, local_world)
        if device.type == "cpu":
            _check_build_fits_the_host(cfg, local_world)
        # From a shell: once, before any rank starts. Under a launcher: every rank, before
        # joining the group (one builds the cache under a file lock, the others wait), so a
        # large corpus never meets the collective timeout.
        _prepare_data(cfg)
        if args.command == "train":  # every input checked: claim the folder, the last step before ranks start
            out_lock = _own_out(cfg, renv)
    except (C.ConfigError, DataError, launch.LaunchError, OwnerError, OutLocked) as e:
        _release(out_lock)
        if renv is None:
            print(f"meshtrain: error: {e}", file=sys.stderr)
            return 2
        # Every rank says it: the launcher may stop the others as soon as the first one exits.
        print(f"meshtrain: error (rank {renv.rank}): {e}", file=sys.stderr)
        return launch.finish(2)

    launch.at_finish(lambda: _release(out_lock))  # a rank leaves through os._exit
    try:
        if renv is None and _ranks_to_start(cfg, args) > 1:
            return _launch_local(cfg, args, argv)
        return _run_here(cfg, args, renv, device)
    except KeyboardInterrupt:  # Ctrl-C reaches every rank: leave quietly, the launcher reports it
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        return launch.finish(130) if renv else 130
    finally:
        _release(out_lock)


def _own_out(cfg: C.Config, renv):
    """A training run's hold on --out, taken before any rank starts by the process that lives
    as long as the run (meshtrain's launcher across its restarts, or rank 0 under an outside
    launcher): the lock (`checkpoint.lock`), then the run id (`checkpoint.owner.claim`),
    handed to the ranks in the environment. None for the ranks of meshtrain's own launcher
    and the other ranks of an outside one."""

    if renv is not None and (renv.rank != 0 or os.environ.get(owner.RUN_ID_ENV)):
        return None
    tr = cfg.train
    lock = OutLock(Path(tr.out), _log).acquire()
    try:
        run = owner.claim(Path(tr.out), resume=tr.resume, resume_from=tr.resume_from, overwrite=tr.overwrite,
                          log=_log, restarted=faults.restart_count() > 0)
    except owner.OwnerError:
        lock.release()
        raise
    os.environ[owner.RUN_ID_ENV] = run
    if renv is None:  # meshtrain's own launcher: one id for this launch, which its restarts share
        os.environ[lineage.JOB_ENV] = lineage.new_job_id()
    return lock


def _release(out_lock) -> None:
    """Give --out back: the lock, and the run id this process handed to its ranks."""
    if out_lock is not None:
        out_lock.release()
        os.environ.pop(RUN_ID_ENV, None)
        os.environ.pop(lineage.JOB_ENV, None)


def _log(msg: str) -> None:
    print(f"meshtrain: {msg}", file=sys.stderr, flush=True)


def _prepare_data(cfg: C.Config) -> None:
    from meshtrain.data.datasets import prepare
    kind = "mlp" if cfg.train.data == "digits" else cfg.model.name  # images need no preparing
    prepare(cfg.train.data, kind, cfg.train.vocab_size, cfg.train.seq_len, log=_log,
            tokenizer=C.imported_tokenizer(cfg))


def _ranks_to_start(cfg: C.Config, args) -> int:
    """From a shell: the most local ranks the command starts at once (`verify --resume-at`
    starts the second layout's after the first's; both in this process when both are 1)."""
    second = C.resumed_config(cfg) if args.command == "verify" and not args.verify_part else None
    return max(cfg.layout.world_size, second.layout.world_size if second else 1)


def _launch_local(cfg: C.Config, args, argv: list[str]) -> int:
    """Start the ranks; for verify, then run the one-process reference here and compare."""
    n = cfg.layout.world_size
    cp = f", cp={cfg.layout.cp}" if cfg.layout.cp > 1 else ""
    _log(f"starting {n} local ranks (dp={cfg.layout.dp}{cp}, tp={cfg.layout.tp}, pp={cfg.layout.pp})")
    if args.command != "verify":
        tr = cfg.train
        return launch.spawn(n, argv, max_restarts=tr.max_restarts if args.command == "train" else 0,
                            restart_point=lambda: _restart_point(tr),
                            clean_stop=lambda since: _stopped_cleanly(tr.out, since))
    import torch

    from meshtrain import verifier as verify
    second = C.resumed_config(cfg)
    with tempfile.TemporaryDirectory(prefix="meshtrain-verify-") as tmp:
        if second is None:
            code = launch.spawn(n, argv + ["--dump-dir", tmp])
            if code:
                return code
            layout = torch.load(Path(tmp, LAYOUT_DUMP), weights_only=False)
        else:  # --resume-at K: steps 1..K in these ranks, saved in tmp; then the second layout's ranks resume
            parts = {}
            for part, lay in ((verify.FIRST, cfg.layout), (verify.RESUMED, second.layout)):
                if part == verify.RESUMED:
                    _log(f"resuming after step {cfg.train.resume_at}: starting {lay.world_size} local ranks "
                         f"({lay.short()})")
                code = launch.spawn(lay.world_size, argv + ["--dump-dir", tmp, "--verify-part", part])
                if code:
                    return code
                parts[part] = torch.load(Path(tmp, f"{part}-{LAYOUT_DUMP}"), weights_only=False)
            alike = verify.same_ranks(verify.mesh_sizes(cfg.layout), verify.mesh_sizes(second.layout))
            layout = verify.join_parts(parts[verify.FIRST], parts[verify.RESUMED], cfg.train.resume_at,
                                       second.layout.summary(), alike)
    return verify.against_reference(cfg, layout, args.json)


def _run_here(cfg, args, renv, device) -> int:
    """This process is a rank (under a launcher), or the whole job (world size 1): the
    command's collective part inside the group, then its rank-0 part after shutdown."""
    from meshtrain.comm import Comm
    from meshtrain.mesh import Mesh

    if renv is None:
        mesh = Mesh.single(device)
    else:
        launch.init_distributed(renv, device, timeout_s=max(C.START_TIMEOUT_S, cfg.train.timeout),
                                trace_dir=cfg.train.out)
        mesh = Mesh.build(cfg.layout.pp, cfg.layout.dp, cfg.layout.tp, device, cp=cfg.layout.cp, ep=cfg.layout.ep)
    from meshtrain.checkpoint.sharded import CheckpointError
    from meshtrain.run_folder import Preempted, RunRefused
    from meshtrain.train import NonFinite
    try:
        after = _COMMANDS[args.command](cfg, Comm(mesh), args)
    except (CheckpointError, RunRefused, NonFinite, Preempted) as e:  # every rank alike: rank 0 says it
        if mesh.is_main:
            print(f"meshtrain: {'' if isinstance(e, Preempted) else 'error: '}{e}", file=sys.stderr)
        code = {NonFinite: 3, Preempted: 0}.get(type(e), 2)
        if renv is None:
            return code
        launch.shutdown_distributed()
        return launch.finish(code)
    except Exception as e:
        if renv is None or not launch.is_peer_failure(e):
            raise
        # Another rank died or hung: its own failure is the story; say one line, not a traceback.
        reason = str(e).strip().splitlines()[0][:200]
        print(f"meshtrain: rank {renv.rank} stopped: a collective failed ({reason})", file=sys.stderr)
        return launch.finish(launch.PEER_LOST_EXIT)
    if renv is None:
        return after()
    launch.shutdown_distributed()
    return launch.finish(after())


def _train(cfg, comm, args):
    from meshtrain import report
    from meshtrain.metrics import StepLog
    from meshtrain.train import train

    log = StepLog(Path(cfg.train.out) / owner.METRICS_FILE) if comm.mesh.is_main else None
    result = train(cfg, comm, progress="train", step_log=log, trace=bool(args.trace))
    if log:
        log.close()
    gathered = report.gather(result, comm)
    if not comm.mesh.is_main:
        return lambda: 0

    def write() -> int:
        if args.trace:
            import json
            Path(args.trace).write_text(json.dumps(result.trace))
            _log(f"wrote the measured timeline to {args.trace}; compare: meshtrain schedule --trace {args.trace}")
        return report.write(cfg, result, gathered, comm.mesh.device, args.json)
    return write


def _verify(cfg, comm, args):
    """The layout's run; then on rank 0: hand the record to our launching parent (which runs
    the reference), or — under torchrun/srun/mpirun or alone — run the reference here."""
    import torch

    from meshtrain import verifier as verify

    part, second = args.verify_part, None
    if part:  # one part of --resume-at, started by our launching parent (`part_config` made cfg)
        rec = verify.record(cfg, comm, part, resume_at=cfg.train.resume_at, part=part)
    else:
        second = C.resumed_config(cfg, comm.mesh.world_size if launch.detect() else None)
        rec = verify.record_resumed(cfg, second, comm, "layout") if second else verify.record(cfg, comm, "layout")
    if not comm.mesh.is_main:
        return lambda: 0

    def hand_over() -> int:
        torch.save(rec, Path(args.dump_dir, f"{part}-{LAYOUT_DUMP}" if part else LAYOUT_DUMP))
        return 0
    return hand_over if args.dump_dir else lambda: verify.against_reference(cfg, rec, args.json)


def bench_options(cfg: C.Config, peer: str):
    """`meshtrain bench`'s typed options from the configuration: what the peer is built from,
    and the train loop's pieces ours and the peer run in (`train.setup`, `job_for`, `train_step`)."""
    from meshtrain import bench, train

    tr = cfg.train
    peer_options = bench.PeerOptions(layout=cfg.layout, build_model=lambda device: train.build(cfg, device)[1],
                                     lr=tr.lr, weight_decay=tr.weight_decay,
                                     pipeline=pipeline_plan_of(cfg.model.spec()) if peer == "torch-pp" else None)
    return bench.BenchOptions(peer=peer_options, ours=lambda comm: train.setup(cfg, comm),
                              as_job=lambda p: train.job_for(p, cfg),
                              step=lambda job, data, i: train.train_step(job, data, i, cfg), steps=tr.steps,
                              model=cfg.model.name)


def _bench(cfg, comm, args):
    from meshtrain import bench

    options = bench_options(cfg, args.vs)
    result = bench.run_bench(options, comm, args.vs)
    if not comm.mesh.is_main:
        return lambda: 0
    return lambda: bench.report(options, result, args.json)


_COMMANDS = {"train": _train, "verify": _verify, "bench": _bench}


def _schedule(args) -> int:
    """`meshtrain schedule`: no processes, no data; the simulator and what draws it."""
    import json


    if args.trace:
        return _schedule_against_trace(args)
    p, m, v = args.pp, args.microbatches, args.chunks
    try:
        if p is None or m is None:
            raise ValueError("give --pp and --microbatches (or --trace FILE from `meshtrain train --trace`)")
        for flag, value in (("--pp", p), ("--microbatches", m), ("--chunks", v)):
            if value < 1:
                raise ValueError(f"{flag} {value}: must be a positive integer")
        lists = schedule(args.schedule, p, m, v)
    except ValueError as e:
        print(f"meshtrain: error: {e}", file=sys.stderr)
        return 2
    out = sys.stderr if args.json else sys.stdout
    if m < p:
        print(f"meshtrain: warning: {m} micro-batches for {p} stages: some stages idle through most of the step; "
              f"use --microbatches {p} or more", file=sys.stderr)
    sim = simulate(lists, v, microbatches=m)
    title = f"{args.schedule}, p={p}, m={m}" + (f", v={v}" if v > 1 else "")
    print(f"{title}: F forward, B backward, W weight gradient; micro-batch" + (" / chunk" if v > 1 else ""), file=out)
    print(text_timeline(sim), file=out)
    print(f"makespan {float(sim.makespan):g}, bubble_fraction {float(sim.bubble_fraction):.4f}, "
          f"peak_inflight {sim.peak_inflight}", file=out)
    if args.png:
        draw_png(sim, args.png, title)
        print(f"wrote {args.png}", file=out)
    if args.json:
        print(json.dumps(summary(args.schedule, m, sim)), flush=True)
    return 0


def _schedule_against_trace(args) -> int:
    """`meshtrain schedule --trace FILE`: the simulator fed with a real run's measured costs,
    against that run: makespans, order of operations, both timelines."""
    import json

    from meshtrain.parallel.pipeline.trace import compare

    try:
        trace = json.loads(Path(args.trace).read_text())
        result = compare(trace)
    except OSError as e:
        print(f"meshtrain: error: --trace {args.trace}: cannot read it ({e.strerror or e})", file=sys.stderr)
        return 2
    except (ValueError, KeyError, TypeError) as e:
        print(f"meshtrain: error: --trace {args.trace}: not a trace written by `meshtrain train --trace` ({e!r})",
              file=sys.stderr)
        return 2
    out = sys.stderr if args.json else sys.stdout
    predicted, measured = result.pop("predicted"), result.pop("measured")
    forwards = [sp.end - sp.start for sp in measured.spans if sp.kind == "F"]
    unit = min(forwards) if forwards else measured.makespan / 40
    title = f"{trace['model']}, {trace['layout']}"
    for name, sim in (("measured (median step)", measured), ("simulated from measured costs", predicted)):
        print(f"{name}, one cell = {unit * 1e3:.1f} ms:", file=out)
        print(text_timeline(sim, unit), file=out)
    print(f"makespan: simulated {result['predicted_makespan_s'] * 1e3:.1f} ms, measured "
          f"{result['measured_makespan_s'] * 1e3:.1f} ms (median of {len(trace['steps']) - 1 or 1} steps), "
          f"ratio {result['predicted_over_measured']:.3f}; p2p {trace['p2p_s'] * 1e3:.2f} ms per transfer; "
          f"same order of operations on every stage: {'yes' if result['same_order'] else 'NO'}", file=out)
    for stage, ops in enumerate(result["op_median_s_per_stage"]):
        print(f"stage {stage}, median ms: " + ", ".join(f"{k} {t * 1e3:.1f}" for k, t in ops.items()), file=out)
    if args.png:
        draw_panels([(measured, f"measured: {title}"), (predicted, "simulated from the measured costs")], args.png,
                    "seconds from the step's start")
        print(f"wrote {args.png}", file=out)
    if args.json:
        print(json.dumps(result), flush=True)
    return 0


def _prepare(args) -> int:
    """`meshtrain prepare`: no torch; one line for each refusal, and for an interruption
    (Ctrl-C, SIGTERM: the workers stopped, --out left absent, exit 128 + the signal)."""
    from meshtrain.data.build import default_workers, imported_tokenizer_and_rows, prepare_folder
    from meshtrain.data.prepared import find
    vocab, tokenizer = args.vocab_size if args.vocab_size is not None else C.TrainConfig.vocab_size, None
    workers = args.workers if args.workers is not None else default_workers()

    def stop(signum, frame):  # raised where the process is, so that what it was building is removed
        raise KeyboardInterrupt(signal.Signals(signum))
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    try:
        if workers < 1:
            raise C.ConfigError(f"--workers {workers}: use 1 (tokenize in this process) or more")
        if args.init_from is not None:
            if args.vocab_size is not None:
                raise C.ConfigError(f"--vocab-size {args.vocab_size} with --init-from {args.init_from}: the vocabulary "
                                    f"is that folder's tokenizer's; give one of them")
            tokenizer, vocab = imported_tokenizer_and_rows(Path(args.init_from))
        elif not 256 <= vocab <= 2**20:
            raise C.ConfigError(f"--vocab-size {vocab}: use 256 (bytes) up to {2**20:,}")
        if args.data not in C.BUILTIN_DATA and find(args.data) is not None:
            raise C.ConfigError(f"--data {args.data} is a prepared token folder already; train on it with "
                                f"meshtrain train --data {args.data}")
        meta = prepare_folder(args.data, Path(args.out), vocab, tokenizer, log=_log, workers=workers,
                              text_field=args.text_field, progress=True)
    except (C.ConfigError, DataError) as e:
        print(f"meshtrain: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        sig = e.args[0] if e.args else signal.SIGINT
        print(f"meshtrain: error: prepare stopped by {sig.name}; --out {args.out} was not written (its "
              f"unfinished folder removed): run it again", file=sys.stderr)
        return 128 + sig
    init = f" --init-from {args.init_from}" if args.init_from else ""
    _log(f"prepared {meta['documents']:,} document(s) into {meta['n_tokens']:,} tokens ({meta['dtype']}, "
         f"{len(meta['shards'])} shard(s)) in {args.out}; train on them: meshtrain train --data {args.out}{init}")
    return 0


def _export(args) -> int:
    """`meshtrain export`: --out is checked and held (`export_out`) before anything is read
    or written."""
    from meshtrain.checkpoint.export import DTYPES, export
    from meshtrain.checkpoint.sharded import CheckpointError
    from meshtrain.cli.export_out import writing_into
    bad = [(not args.max_shard_gb > 0, f"--max-shard-gb {args.max_shard_gb}: must be positive"),
           (args.dtype is not None and args.dtype not in DTYPES,
            f"unknown dtype '{args.dtype}'; use --dtype {' | '.join(DTYPES)}")]
    for is_bad, message in bad:
        if is_bad:
            print(f"meshtrain: error: {message}", file=sys.stderr)
            return 2
    dtype, max_shard_bytes = DTYPES.get(args.dtype), int(args.max_shard_gb * 1e9)
    try:
        with writing_into(Path(args.out), Path(args.ckpt), overwrite=args.overwrite, log=_log) as ready:
            if args.hf:
                return _export_hf(Path(args.ckpt), Path(args.out), dtype, max_shard_bytes, ready)
            files = export(Path(args.ckpt), Path(args.out), dtype=dtype, max_shard_bytes=max_shard_bytes, log=_log,
                           before_writing=ready)
    except (CheckpointError, FileNotFoundError, ValueError) as e:  # export_out's refusals and OutLocked are ValueErrors
        print(f"meshtrain: error: {e}", file=sys.stderr)
        return 2
    _log(f"exported {args.ckpt} to {args.out} ({len(files)} weight file{'s' if len(files) > 1 else ''}); "
         f"sample from it with: meshtrain generate --ckpt {args.out}")
    return 0


def _export_hf(ckpt: Path, out: Path, dtype, max_shard_bytes: int, ready) -> int:
    """A Llama or MoE checkpoint (or run folder, or plain export) as a complete Hugging Face folder."""
    from meshtrain.cli.hf_export import export_hf
    files = export_hf(ckpt, out, dtype=dtype, max_shard_bytes=max_shard_bytes, log=_log, before_writing=ready)
    written = sorted(name for name in (*SIDE_FILES, TOKENIZER) if (out / name).is_file())
    if "tokenizer.json" not in written:
        _log(f"warning: {ckpt} keeps no tokenizer.json, so {out} has none: put the run's tokenizer there before "
             f"loading it with transformers' AutoTokenizer")
    _log(f"exported {ckpt} to {out} as a Hugging Face folder ({', '.join(written)} and {len(files)} weight "
         f"file{'s' if len(files) > 1 else ''}); transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}) "
         f"loads it, and so does meshtrain generate --ckpt {out}")
    return 0


def _generate(args) -> int:
    from meshtrain.cli.run_model import load_model
    from meshtrain.generate import sample

    bad = [(args.tokens < 0, f"--tokens {args.tokens}: must not be negative"),
           (args.top_k < 0, f"--top-k {args.top_k}: must not be negative (0 samples from every token)"),
           (not args.temperature > 0, f"--temperature {args.temperature}: must be positive"),
           (args.device not in C.DEVICES, f"unknown device '{args.device}'; use --device {' | '.join(C.DEVICES)}")]
    try:
        for is_bad, message in bad:
            if is_bad:
                raise C.ConfigError(message)
        device = launch.choose_device(args.device, 0, 1)
        model, tokenizer, cfg = load_model(Path(args.ckpt), device)
    except (C.ConfigError, launch.LaunchError, FileNotFoundError, ValueError) as e:
        print(f"meshtrain: error: {e}", file=sys.stderr)
        return 2
    prompt = tokenizer.encode_prompt(args.prompt)
    ids = sample(model, prompt, args.tokens, cfg.train.seq_len, temperature=args.temperature,
                 top_k=args.top_k, seed=args.seed)
    print(args.prompt + tokenizer.decode(ids))
    return 0

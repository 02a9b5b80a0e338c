"""`meshtrain train | verify | bench`: the configuration checked (flags, TOML, the layout,
then what only this host can say: --out, the resume source, the data, the device, memory),
--out claimed, then the ranks started from a shell (`_launch_local`) or joined under a
launcher (`_run_here`).

Each command has a collective part, which every rank runs inside the process group, and a
part for rank 0 alone (writing files, the verify reference, printing), which runs after the
group is shut down: nothing slow ever holds the other ranks inside a timed collective
(`_COMMANDS`)."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from pathlib import Path

from meshtrain import board, faults, launch
from meshtrain.checkpoint import lineage, owner
from meshtrain.checkpoint.folders import COMPLETE, steps_in_local
from meshtrain.checkpoint.lock import OutLock, OutLocked, heartbeat_of_environment
from meshtrain.checkpoint.owner import OwnerError, RUN_ID_ENV, read_run
import meshtrain.cli.config as C
import meshtrain.cli.ft as ft
from meshtrain.cli.log import log
from meshtrain.cli.resume_at import resumed_config
from meshtrain.cli.validate import validate, warnings
from meshtrain.data.corpus import DataError
from meshtrain.recipe import is_user_model
from meshtrain.recipes import family_of

LAYOUT_DUMP = "layout.pt"


def run(args, argv: list[str], rank_function=None) -> int:
    """Check everything that can be checked before a rank starts, claim --out (train), then
    start the ranks or run as one. `rank_function(argv, launcher_env)`: what each local rank
    runs when forked from a preloaded server (`cli.forked_ranks`; `cli.forked_rank`), where
    torch's engine allows it; otherwise each rank is `python -m meshtrain ARGV`."""
    renv, out_lock = None, None
    try:
        renv = launch.detect()
        ours = renv is not None and bool(os.environ.get(launch.LAUNCHER_PID_ENV))  # a rank meshtrain started
        if ours:
            launch.name_this_rank(renv.rank)
            launch.die_with_launcher()
        cfg = _config_from(args)
        if args.command == "train":
            ft.check_before_planning(cfg)
        server = renv is None and rank_function is not None and _searching_from_a_shell(cfg, args)
        if server:  # before the search's planner looks at the GPUs: the server is a fork of this process
            rank_function = _forked_ranks_server(rank_function, args.command)
        args.search_plan = _search_plan(cfg, args, renv)  # --layout-search: cfg.layout is the first candidate
        if args.search_plan is not PENDING:  # a rank waiting for rank 0's search validates its choice
            validate(cfg, world_size=renv.world_size if renv else None)
        if args.command == "train":
            ft.check(cfg, renv)
        _check_command(cfg, args)
        speaks = renv.rank == 0 if renv else cfg.layout.world_size == 1  # rank 0 reports, once
        speaks = speaks and not cfg.ft.replica_id  # replica groups: group 0's
        if args.command == "train" and (renv is None or renv.rank == 0):
            _check_out_writable(cfg.train.out)
        if args.command == "train":
            _check_resume_source(cfg.train)
            if cfg.train.tensorboard:
                if not board.available():
                    raise C.ConfigError(board.MISSING)
        said = [*warnings(cfg, args.command), launch.cross_node_restart_warning(renv)] if speaks else []
        for warning in filter(None, said):
            print(f"meshtrain: warning: {warning}", file=sys.stderr)
        if renv is not None and not ours and cfg.train.max_restarts and speaks:  # meshtrain's launcher restarts
            print("meshtrain: warning: under a launcher, restarts are the launcher's (torchrun --max-restarts N); "
                  "--max-restarts is ignored, and restarted ranks resume from the latest checkpoint by themselves",
                  file=sys.stderr)
        if renv is None and rank_function is not None and not server and _ranks_to_start(cfg, args) > 1 \
                and not ft.launches_groups(cfg, renv):
            rank_function = _forked_ranks_server(rank_function, args.command)
        # From a shell the local ranks are all ours: check the GPUs before starting them.
        local_rank, local_world = (renv.local_rank, renv.local_world_size) if renv else (0, cfg.layout.world_size)
        if ft.launches_groups(cfg, renv):  # R groups of the layout on this host
            local_world *= cfg.ft.replicas
        device = launch.choose_device(cfg.train.device, local_rank, local_world)
        _check_fp8(cfg, device)
        if device.type == "cpu":
            if args.search_plan is not PENDING:
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
        if ft.launches_groups(cfg, renv):  # --ft-replicas from a shell: the lighthouse and R groups
            return ft.launch_groups(cfg, argv, log)
        if renv is None and (_ranks_to_start(cfg, args) > 1 or ft.is_a_group_launcher(cfg, renv)):
            return _launch_local(cfg, args, argv, rank_function)
        return _run_here(cfg, args, renv, device)
    except KeyboardInterrupt:  # Ctrl-C reaches every rank: leave quietly, the launcher reports it
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        return launch.finish(130) if renv else 130
    finally:
        _release(out_lock)


def _config_from(args) -> C.Config:
    """The run's configuration (`cli.config.from_args`); for a rank of one part of `verify
    --resume-at`, started by the parent, that part's."""
    cfg = C.from_args(args)
    if getattr(args, "verify_part", None):
        from meshtrain import verifier
        validate(cfg)  # as the parent did, from its shell
        cfg = verifier.part_config(cfg, resumed_config(cfg), args.verify_part, Path(args.dump_dir))
    return cfg


# A rank of a searched run other than rank 0 under a launcher: it takes rank 0's plan once the
# group is formed (planning a large world takes seconds to minutes; one rank does it).
PENDING = "pending"


def _searching_from_a_shell(cfg: C.Config, args) -> bool:
    """A --layout-search of more than one local rank, from a shell (not a rank)."""
    if not (cfg.search.enabled and args.command == "train"):
        return False
    from meshtrain.cli.layout_search import world_of
    return world_of(cfg, None) > 1


def _search_plan(cfg: C.Config, args, renv):
    """--layout-search: the candidates the ranks will profile (`cli.layout_search`), cfg's
    layout set to the first meanwhile (what the ranks start with; the checks below run on
    it); PENDING on a launcher's rank other than 0; None without the search."""
    if not cfg.search.enabled:
        given = [C.flag_of(*key) for key in sorted(cfg.given) if key[0] == "search"]
        if given:
            what = "is a --layout-search setting" if len(given) == 1 else "are --layout-search settings"
            raise C.ConfigError(f"{', '.join(given)} {what}; add --layout-search, or drop "
                                + ("it" if len(given) == 1 else "them"))
        return None
    if args.command != "train":
        raise C.ConfigError(f"--layout-search ([layout] search) is train's: {args.command} runs the layout it is given")
    from meshtrain.cli.layout_search import plan_search
    from meshtrain.cli.validate import adopt_imported_model, adopt_prepared_data

    if renv is not None and renv.rank != 0:
        adopt_imported_model(cfg)
        adopt_prepared_data(cfg)
        return PENDING
    device = cfg.train.device
    if device == "auto":
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    tr = cfg.train
    plan = plan_search(cfg, renv.world_size if renv else None, renv.local_world_size if renv else None, device,
                       resuming=bool(tr.resume or tr.resume_from), restarted=faults.restart_count() > 0)
    cfg.layout = plan.candidates[plan.chosen if plan.chosen is not None else 0].layout
    return plan


def _check_command(cfg: C.Config, args) -> None:
    if args.command == "verify" and not getattr(args, "verify_part", None):  # both layouts, before any rank starts
        renv = launch.detect()
        resumed_config(cfg, renv.world_size if renv else None)
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
        if cfg.layout.fp8 != "none" or cfg.train.optimizer != "adamw":
            raise C.ConfigError("bench times a strategy against its PyTorch peer, which runs bf16/fp32 matmuls and "
                                "AdamW; drop --fp8 and --optimizer there, and compare fp8 and the low-bit optimizers "
                                "with benchmarks/fp8.py (benchmarks/fp8_gpu.py on a GPU)")
        if args.vs not in C.BENCH_PEERS:
            raise C.ConfigError(f"unknown peer '{args.vs}'; use --vs {' | '.join(C.BENCH_PEERS)}")
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


def _check_fp8(cfg: C.Config, device) -> None:
    """--fp8 on this device (emulated, or fp8 matmuls present), and a preset with a linear
    layer it converts (its structure built on meta; a user's model is checked where it is built)."""
    options = cfg.layout.fp8_options()
    if options is None:
        return
    import torch
    from meshtrain.parallel.expert_load import expert_routers
    from meshtrain.parallel.fp8 import fp8_layer_names, fp8_problem
    from meshtrain.recipes.build import preset_recipe
    problem = fp8_problem(device, options.emulate)
    if problem:
        raise C.ConfigError(problem)
    if is_user_model(cfg.model.name):
        return
    m = cfg.model
    recipe = preset_recipe(m.name, dropout=m.dropout, attention=m.attention, mlp_hidden=m.mlp_hidden,
                           moe=m.moe_options())
    with torch.device("meta"):
        model = recipe.make_model()
    try:
        fp8_layer_names(model, options, recipe.pipeline.blocks if recipe.pipeline else None, expert_routers(model))
    except ValueError as e:
        raise C.ConfigError(f"{e} ({m.name})") from None


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
    from meshtrain.metrics import available_host_bytes
    need, have = 4 * part * local_ranks, available_host_bytes()
    if have is not None and need > have:
        what = f"--mlp-hidden {cfg.model.mlp_hidden}" if cfg.model.mlp_hidden else f"--model {cfg.model.name}"
        raise C.ConfigError(f"{what}: building its part takes 4 bytes × {part / 1e9:.2f} B parameters on each of "
                            f"{local_ranks} local rank(s), {need / 2**30:.1f} GiB; this host has {have / 2**30:.1f} GiB "
                            f"available; use a smaller model, more sharding (--tp, --pp, --zero 3) or fewer ranks "
                            f"per host")


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


def _own_out(cfg: C.Config, renv):
    """A training run's hold on --out, taken before any rank starts by the process that lives
    as long as the run (meshtrain's launcher across its restarts, or rank 0 under an outside
    launcher): the lock (`checkpoint.lock`), then the run id (`checkpoint.owner.claim`),
    handed to the ranks in the environment. None for the ranks of meshtrain's own launcher
    and the other ranks of an outside one."""

    if renv is not None and (renv.rank != 0 or os.environ.get(owner.RUN_ID_ENV)):
        return None
    if ft.is_a_group_launcher(cfg, renv) or (cfg.ft.replicas and cfg.ft.replica_id):  # group 0's, or the launcher's
        return None
    tr = cfg.train
    if renv is None:  # meshtrain's own launcher: one id for this launch, which its restarts share (the lock's)
        os.environ[lineage.JOB_ENV] = lineage.new_job_id()
    heartbeat_s, stale_s = heartbeat_of_environment()
    lock = OutLock(Path(tr.out), log, heartbeat_s=heartbeat_s, stale_s=stale_s, on_lost=_stop_the_job)
    try:
        lock.acquire()
        run = owner.claim(Path(tr.out), resume=tr.resume, resume_from=tr.resume_from, overwrite=tr.overwrite,
                          log=log, restarted=faults.restart_count() > 0)
    except BaseException:
        lock.release()
        if renv is None:
            os.environ.pop(lineage.JOB_ENV, None)
        raise
    os.environ[owner.RUN_ID_ENV] = run
    return lock


def _stop_the_job(line: str) -> None:
    """The lock was taken over (this job's heartbeat seemed stopped to another job): say so,
    and stop every rank under this process at once, so that none writes into --out again (a
    SIGTERM would have them save), then this process."""
    launch.kill_descendants(signal.SIGKILL)
    print(f"\nmeshtrain: error: {line}", file=sys.stderr, flush=True)  # after a rank's progress bar
    os._exit(2)


def _release(out_lock) -> None:
    """Give --out back: the lock, and the run id this process handed to its ranks."""
    if out_lock is not None:
        out_lock.release()
        os.environ.pop(RUN_ID_ENV, None)
        os.environ.pop(lineage.JOB_ENV, None)


def _prepare_data(cfg: C.Config) -> None:
    from meshtrain.data.datasets import prepare
    kind = "mlp" if cfg.train.data == "digits" else cfg.model.name  # images need no preparing
    prepare(cfg.train.data, kind, cfg.train.vocab_size, cfg.train.seq_len, log=log,
            tokenizer=C.imported_tokenizer(cfg))


def _ranks_to_start(cfg: C.Config, args) -> int:
    """From a shell: the most local ranks the command starts at once (`verify --resume-at`
    starts the second layout's after the first's; both in this process when both are 1)."""
    second = resumed_config(cfg) if args.command == "verify" and not args.verify_part else None
    return max(cfg.layout.world_size, second.layout.world_size if second else 1)


def _forked_ranks_server(rank_function, command: str):
    """The rank function, its fork server started (`cli.forked_ranks`) — before this launcher
    touches CUDA, holds --out or prepares data, whose state a fork must not carry; None where
    torch's engine cannot run it (each rank is then a program). Verify's launcher runs the
    one-process reference after its ranks, with all they import: it imports that first, and
    the server inherits it."""
    import meshtrain.cli.forked_ranks as forked_ranks
    if not forked_ranks.usable():
        return None
    forked_ranks.start_server(import_here=command == "verify")
    return rank_function


def _launch_local(cfg: C.Config, args, argv: list[str], rank_function=None) -> int:
    """Start the ranks; for verify, then run the one-process reference here and compare."""
    n = cfg.layout.world_size
    searched = getattr(args, "search_plan", None)
    log(f"starting {n} local ranks (" + (f"the layout searched over {len(searched.candidates)} candidates)"
                                         if searched is not None and searched.chosen is None
                                         else f"{cfg.layout.short()})"))  # every axis, ep and cp included
    if args.command != "verify":
        tr = cfg.train
        return launch.spawn(n, argv, rank_function=rank_function,
                            max_restarts=tr.max_restarts if args.command == "train" else 0,
                            restart_point=lambda: _restart_point(tr),
                            clean_stop=lambda since: _stopped_cleanly(tr.out, since))
    import torch

    from meshtrain import verifier as verify
    second = resumed_config(cfg)
    with tempfile.TemporaryDirectory(prefix="meshtrain-verify-") as tmp:
        if second is None:
            code = launch.spawn(n, argv + ["--dump-dir", tmp], rank_function=rank_function)
            if code:
                return code
            layout = torch.load(Path(tmp, LAYOUT_DUMP), weights_only=False)
        else:  # --resume-at K: steps 1..K in these ranks, saved in tmp; then the second layout's ranks resume
            parts = {}
            for part, lay in ((verify.FIRST, cfg.layout), (verify.RESUMED, second.layout)):
                if part == verify.RESUMED:
                    log(f"resuming after step {cfg.train.resume_at}: starting {lay.world_size} local ranks "
                         f"({lay.short()})")
                code = launch.spawn(lay.world_size, argv + ["--dump-dir", tmp, "--verify-part", part],
                                    rank_function=rank_function)
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

    from meshtrain.checkpoint.sharded import CheckpointError
    from meshtrain.parallel.experts import LoadOverBound
    from meshtrain.run_folder import Preempted, RunRefused
    from meshtrain.search_plan import SearchRefused
    from meshtrain.train import NonFinite
    if renv is not None:
        launch.init_distributed(renv, device, timeout_s=max(C.START_TIMEOUT_S, cfg.train.timeout),
                                trace_dir=cfg.train.out)
    mesh = None
    try:
        if getattr(args, "search_plan", None) is not None:  # rank 0's, profiled on these ranks; the run trains the winner
            from meshtrain.cli.layout_search import config_trial
            from meshtrain.layout_search import search_on_ranks
            from meshtrain.search_plan import RESULT_FILE
            args.search_plan = search_on_ranks(None if args.search_plan is PENDING else args.search_plan, device,
                                               config_trial(cfg),
                                               result=Path(cfg.train.out) / RESULT_FILE,
                                               out=sys.stderr if args.json else sys.stdout)
            cfg.layout = args.search_plan.candidates[args.search_plan.chosen].layout
            validate(cfg, world_size=renv.world_size if renv else None)  # as rank 0 did before the ranks began
        mesh = (Mesh.build(cfg.layout.pp, cfg.layout.dp, cfg.layout.tp, device, cp=cfg.layout.cp, ep=cfg.layout.ep)
                if renv is not None else Mesh.single(device))
        after = _COMMANDS[args.command](cfg, Comm(mesh), args)
    except (CheckpointError, RunRefused, NonFinite, Preempted, LoadOverBound, SearchRefused,
            C.ConfigError) as e:  # every rank alike (a strategy's refusal of the layout: C.ConfigError)
        if (mesh.is_main if mesh is not None else renv is None or renv.rank == 0):
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

    lead = not (cfg.ft.replicas and cfg.ft.replica_id)  # replica group 0 writes the run's folder, alone
    if not lead:
        cfg.train.save_every = None
    step_log = None
    if comm.mesh.is_main:  # another replica group's steps go to a log of its own, every attempt's kept
        step_log = StepLog(Path(cfg.train.out) / owner.METRICS_FILE) if lead else \
            StepLog(Path(cfg.train.out) / ft.group_log(cfg.ft.replica_id), append=True)
    result = train(cfg, comm, progress="train" if lead else None, step_log=step_log, trace=bool(args.trace))
    if step_log:
        step_log.close()
    if not lead:
        return lambda: 0
    gathered = report.gather(cfg, result, comm)
    if not comm.mesh.is_main:
        return lambda: 0

    def write() -> int:
        if args.trace:
            import json
            Path(args.trace).write_text(json.dumps(result.trace))
            log(f"wrote the measured timeline to {args.trace}; compare: meshtrain schedule --trace {args.trace}")
        searched = getattr(args, "search_plan", None)
        extra = {"layout_search": searched.record()} if searched is not None else {}
        if result.ft is not None:
            extra["ft"] = result.ft
        return report.write(cfg, result, gathered, comm.mesh.device, args.json, extra=extra)
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
        second = resumed_config(cfg, comm.mesh.world_size if launch.detect() else None)
        rec = verify.record_resumed(cfg, second, comm, "layout") if second else verify.record(cfg, comm, "layout")
    if not comm.mesh.is_main:
        return lambda: 0

    def hand_over() -> int:
        torch.save(rec, Path(args.dump_dir, f"{part}-{LAYOUT_DUMP}" if part else LAYOUT_DUMP))
        return 0
    return hand_over if args.dump_dir else lambda: verify.against_reference(cfg, rec, args.json)


def _bench(cfg, comm, args):
    from meshtrain.cli.bench import run
    return run(cfg, comm, args)


_COMMANDS = {"train": _train, "verify": _verify, "bench": _bench}

import io
import json
import os
import re
import signal
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

# Small, fast settings shared by the end-to-end tests: the strategies' test preset on bytes of
# Shakespeare, on the CPU (so the suite runs unchanged on a machine with GPUs).
TINY = ["--model", "gpt-test", "--vocab-size", "256", "--seq-len", "32", "--batch-size", "8", "--device", "cpu"]


def small_config(model: str, steps: int, batch: int, **layout):
    """A `Config` for a run inside spawned ranks: `model` on its small data (digits for the
    MLP, bytes of Shakespeare cut to 32 tokens for a GPT), on the CPU, with small buckets."""
    from meshtrain.cli.config import Config
    c = Config()
    c.model.name = model
    c.layout.bucket_mb = 0.02
    for key, value in layout.items():
        setattr(c.layout, key, value)
    c.train.steps, c.train.batch_size, c.train.device = steps, batch, "cpu"
    if model == "mlp":
        c.train.data = "digits"
    else:
        c.train.seq_len, c.train.vocab_size = 32, 256
    return c


def cli_config(*args):
    """The `Config` that `meshtrain ARGS` runs: the command line's own parser, defaults and
    checks (a refused layout raises `ConfigError`, as the command line refuses it)."""
    from meshtrain.cli import build_parser
    from meshtrain.cli.config import from_args
    from meshtrain.cli.validate import validate
    cfg = from_args(build_parser().parse_args([str(a) for a in args]))
    validate(cfg)
    return cfg


def on_the_layout(fn, cfg, *args, timeout: float = 180):
    """`fn(mesh, cfg, *args)` on the ranks of `cfg`'s layout (its world, its mesh's sizes),
    forked from the preloaded server; each rank's result."""
    from distributed import run_ranks
    lay = cfg.layout
    return run_ranks(fn, lay.world_size, cfg, *args, pp=lay.pp, tp=lay.tp, cp=lay.cp, ep=lay.ep, timeout=timeout)


def _record(mesh, cfg, paths=()):
    sys.path[:0] = paths
    from meshtrain import verifier
    from meshtrain.comm import Comm
    return verifier.record(cfg, Comm(mesh), "layout")


def _proc_stat(pid: int) -> tuple[str, int, str] | None:
    """(name, parent pid, state) of a process (Linux /proc), None once it has gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    state, parent = text.rsplit(")", 1)[1].split()[:2]
    return text[text.index("(") + 1:text.rindex(")")], int(parent), state


def process_name(pid: int) -> str | None:
    stat = _proc_stat(pid)
    return stat and stat[0]


def parent_of(pid: int) -> int | None:
    stat = _proc_stat(pid)
    return stat and stat[1]


def is_running(pid: int) -> bool:
    """Whether the process is there and not a zombie waiting to be reaped."""
    stat = _proc_stat(pid)
    return stat is not None and stat[2] != "Z"


def ranks_of(launcher_pid: int) -> dict[int, int]:
    """{rank: pid} of the ranks a meshtrain launcher started, among its descendants (a forked
    rank is its fork server's child): each names itself `meshtrain rN` (Linux /proc)."""
    stats = {int(p.name): _proc_stat(int(p.name)) for p in Path("/proc").glob("[0-9]*")}
    parents = {pid: stat[1] for pid, stat in stats.items() if stat}

    def descends(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == launcher_pid:
                return True
        return False
    return {int(stat[0].rsplit("r", 1)[1]): pid for pid, stat in stats.items()
            if stat and re.fullmatch(r"meshtrain r\d+", stat[0]) and descends(pid)}


_TRAJECTORIES: dict = {}  # (the one-process configuration, the sampled steps) -> its trajectory


def verdict(cfg, record: dict) -> dict:
    """verify's verdict on a layout's `record` against the one-process reference. The
    reference's own trajectory (its losses, its weights after the sampled steps) is a function
    of its one-process configuration and the steps alone — many layouts share it (every dp,
    ZeRO and pipeline variant of one model and batch) —, so this process computes it once for
    all of them; the lockstep steps from each record's own states are computed every time."""
    from meshtrain import verifier
    key = (repr(verifier.reference_config(cfg)), tuple(sorted(record["steps"])))
    if key not in _TRAJECTORIES:
        if len(_TRAJECTORIES) >= 32:  # a few MB each on the test models; gpt-small's are larger
            _TRAJECTORIES.pop(next(iter(_TRAJECTORIES)))
        _TRAJECTORIES[key] = verifier.reference_trajectory(cfg, list(key[1]))
    return verifier.compare(record, verifier.run_reference(cfg, record, _TRAJECTORIES[key]))


def verify_in_ranks(cfg, timeout: float = 600, paths=()) -> dict:
    """What `meshtrain verify` computes, without its interpreters: the layout's ranks record
    (forked from the preloaded server, as in every multi-rank test), this process runs the
    one-process reference and compares — the calls its ranks and its launching parent make.
    The verdict, with the `--json` report's `layout` key. `paths`: folders the ranks put
    first on sys.path (what PYTHONPATH gives a command's ranks: a user's module or plugin)."""
    record = on_the_layout(_record, cfg, tuple(map(str, paths)), timeout=timeout)[0]
    return {"layout": cfg.layout.summary(), **verdict(cfg, record)}


def _train(mesh, cfg):
    from meshtrain.comm import Comm
    from meshtrain.train import train
    return train(cfg, Comm(mesh)).losses


def train_in_ranks(cfg, timeout: float = 600) -> list:
    """What the ranks of `meshtrain train` do (`train.train` on the layout's mesh: the steps,
    the checkpoints `--save-every` asks for, in `--out`), in ranks forked from the preloaded
    server; the losses. A run's own process boundary (launching, the run's log and report)
    is checked by the tests that run the command."""
    from meshtrain.cli.config import imported_tokenizer
    from meshtrain.data.datasets import prepare
    # what the command does before its ranks start: --out made, the data prepared once
    os.makedirs(cfg.train.out, exist_ok=True)
    prepare(cfg.train.data, "mlp" if cfg.train.data == "digits" else cfg.model.name, cfg.train.vocab_size,
            cfg.train.seq_len, log=lambda line: None, tokenizer=imported_tokenizer(cfg))
    return on_the_layout(_train, cfg, timeout=timeout)[0]


# The commands that import torch, its compiler and meshtrain's trainer whatever they are asked
# (and `plan --measure`, which trains): `run_cli` forks them from the tests' preloaded server
# (`distributed.run_command`), which spares each ~3 s of CPU importing, unless `fresh` says the
# interpreter's start is the subject.
FORKED_COMMANDS = ("train", "verify", "bench")


def _forked(argv: list[str]) -> bool:
    return bool(argv) and (argv[0] in FORKED_COMMANDS or argv[0] == "plan" and "--measure" in argv)


def run_cli(*args, timeout=300, env=None, launcher=("-m", "meshtrain"), fresh=False):
    """`python -m meshtrain ARGS` in a process of its own, as a user would run it (a fresh
    interpreter, or for FORKED_COMMANDS one forked from the tests' preloaded server); another
    `launcher` (torchrun, a script) is always a fresh interpreter."""
    argv, env = [str(a) for a in args], {**os.environ, **(env or {})}
    if launcher == ("-m", "meshtrain") and _forked(argv) and not fresh:
        from distributed import run_command
        return run_command(argv, env, timeout)
    return subprocess.run([sys.executable, *launcher, *argv], capture_output=True, text=True, timeout=timeout,
                          env=env)


def start_cli(*args, stdout: Path, stderr: Path, env=None):
    """`python -m meshtrain ARGS` started, not waited for, as `run_cli` runs it (for
    FORKED_COMMANDS a process forked from the tests' preloaded server: `distributed.Command`),
    its output in the files `stdout` and `stderr`: for the tests that signal or kill a running
    command. Returns a handle with Popen's `pid`, `send_signal`, `kill`, `wait`, `returncode`."""
    argv, env = [str(a) for a in args], {**os.environ, **(env or {})}
    if _forked(argv):
        from distributed import Command
        return Command(argv, env, stdout, stderr)
    with open(stdout, "w") as out, open(stderr, "w") as err:
        return subprocess.Popen([sys.executable, "-m", "meshtrain", *argv], stdout=out, stderr=err, env=env)


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


def run_main(*args) -> Ran:
    """`meshtrain ARGS` in this process: the `main` that `python -m meshtrain` calls, with its
    output captured. For what runs in one process — a refused input, export, generate, plan,
    schedule — it spares the fresh interpreter (~3 s of torch import here); `run_cli` keeps
    at least one real process per command."""
    from meshtrain.cli import exit_code
    out, err = io.StringIO(), io.StringIO()
    # A command's own handlers die with its process: prepare's, a Ctrl-C at the end of a run,
    # generate's SIGPIPE (the default: this process would then die on a write to a closed pipe).
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE)}
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = exit_code([str(a) for a in args])
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
    return Ran(code, out.getvalue(), err.getvalue())


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])

"""`meshtrain train | verify | bench | schedule | plan | prepare | export | generate` (the
contract in DESIGN.md): the parser, and `main`, which hands each command to its module —
`cli.run` (train, verify, bench), `cli.plan`, `cli.schedule`, `cli.prepare`, `cli.export`,
`cli.generate`. The run flags and the configuration they make are `cli.config`'s, its
checks `cli.validate`'s.

From a plain shell a multi-rank command validates its configuration, prepares the data,
and starts dp×tp×pp local ranks through torchrun's engine; each rank runs this same command
line and finds itself under a launcher, as it does under torchrun, srun or mpirun.

A command's module is imported when that command runs, and what it imports inside its own
functions loads torch (or that command's machinery: the planner's flags, the trainer, DCP)
only then, so that a bad flag is refused, and `--help` and `plan` answer, in a fraction of
a second."""

from __future__ import annotations

import argparse
import signal
import sys

import meshtrain.cli.config as C
from meshtrain.recipes import PUBLISHED


class _Parser(argparse.ArgumentParser):
    """argparse's errors as every other refusal: one line, exit 2 — not the page of usage
    argparse prints first, which buries the line that says what is wrong. Subcommands'
    parsers are of this class too (`add_subparsers` makes its parent's)."""

    def error(self, message: str):
        self.exit(2, f"meshtrain: error: {message} (see {self.prog} --help)\n")


def _add_run_flags(p: argparse.ArgumentParser, steps: int | None = None, flags=C.FLAGS) -> None:
    if flags is C.FLAGS:
        p.add_argument("--config", metavar="FILE", help="TOML file with [model], [layout], [train] sections")
    defaults = C.Config()
    defaults.train.steps = steps or defaults.train.steps
    for flag, section, name, typ, help_text in flags:
        if typ is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                           help=f"{help_text} (default off)")
        else:
            default = getattr(getattr(defaults, section), name)
            # an empty default ("": the preset's) or one the text already states is not shown twice
            shown = f" (default {default})" if default not in (None, "") and "(default" not in help_text else ""
            p.add_argument(flag, type=typ, default=None, help=f"{help_text}{shown}", metavar=typ.__name__.upper())
    if flags is C.FLAGS:
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
    _add_run_flags(train.add_argument_group("layout search"), flags=C.SEARCH_FLAGS)
    _add_run_flags(train.add_argument_group("fault tolerance (torchft)"), flags=C.FT_FLAGS)
    train.add_argument("--trace", metavar="FILE", help="pipeline: also write when each stage ran each forward and "
                       "backward, every step, to FILE (JSON; compare with `meshtrain schedule --trace FILE`)")
    steps = C.COMMAND_STEPS["verify"]
    verify = sub.add_parser("verify", help=f"check a layout against one process (default {steps} steps)",
                            description="Run the layout and one-process training on the same seed and global "
                            "batch. At the first, a middle and the last step the reference takes the step from "
                            "the layout's own state: gradients, updates and the loss must agree per tensor, "
                            "and every rank's copy must match. Exit 0 only then. " + launched)
    _add_run_flags(verify, steps=steps)
    verify.add_argument("--dump-dir", help=argparse.SUPPRESS)  # set by the launching parent
    # --resume-at from a shell: which part these ranks run (`verifier.FIRST` or `RESUMED`), set by the parent
    verify.add_argument("--verify-part", help=argparse.SUPPRESS)
    steps = C.COMMAND_STEPS["bench"]
    bench = sub.add_parser("bench", help=f"ours vs PyTorch's native peer, interleaved (default {steps} steps)",
                           description="Run this project and PyTorch's native peer step by step in the same "
                           "ranks; report median step times and their ratio. " + launched)
    _add_run_flags(bench, steps=steps)
    bench.add_argument("--vs", required=True, metavar="PEER", help="the peer: " + " | ".join(C.BENCH_PEERS))
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
    gen.add_argument("--tokens", type=int, default=200, help="the most tokens to generate (default 200); the model's "
                     "end-of-text token ends the text sooner")
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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(plan_flags=argv[:1] == ["plan"]).parse_args(argv)
    if args.command == "generate":
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `generate ... | head` ends quietly, as Unix tools do
        from meshtrain.cli import generate
        return generate.run(args)
    if args.command == "schedule":
        from meshtrain.cli import schedule
        return schedule.run(args)
    if args.command == "prepare":
        from meshtrain.cli import prepare
        return prepare.run(args)
    if args.command == "export":
        from meshtrain.cli import export
        return export.run(args)
    if args.command == "plan":
        from meshtrain.cli import plan
        try:
            cfg = C.from_args(args)
        except C.ConfigError as e:
            print(f"meshtrain: error: {e}", file=sys.stderr)
            return 2
        return plan.run(args, cfg)
    from meshtrain.cli import run
    return run.run(args, argv, rank_function=forked_rank)


def forked_rank(argv: list[str], launcher_env: dict[str, str]) -> int:
    """One local rank of meshtrain's launcher, forked from its fork server: what `python -m
    meshtrain ARGV` runs, in the process torchrun's engine forked (`cli.forked_ranks`)."""
    from meshtrain import launch
    from meshtrain.cli import forked_ranks
    forked_ranks.adopt(launcher_env)
    return launch.finish(exit_code(argv))


def exit_code(argv: list[str]) -> int:
    """What `python -m meshtrain ARGV` leaves with: main's code, argparse's refusals
    (SystemExit) included."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else int(e.code is not None)

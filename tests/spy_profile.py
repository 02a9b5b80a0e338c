"""Where the suite's CPU goes, by kind of process and by what it runs, from a sampling profile of
every process the suite starts (docs/tests.md, "Where the time goes"):

    py-spy record --subprocesses -r 20 --format raw -o FILE -- python -m pytest -q -m "not slow" -n auto --dist loadfile
    python tests/spy_profile.py FILE [N]

py-spy samples only threads that run, so a share of samples is a share of the CPU the suite
asked for. Each sample is put under the process that took it: a test's rank (forked from
the preloaded server of tests/distributed.py), a rank that meshtrain's own launcher started
(a fresh interpreter), a meshtrain command itself (a launcher, or a one-rank run), a pytest
worker (the one-process references, `run_main`), or another program; and under what it was
doing: importing, compiling (dynamo tracing a frame), or the rest. Then the N modules most
imported in each kind of process."""

from __future__ import annotations

import re
import sys
from collections import Counter


def samples(path: str):
    """(processes, frames, count) of each line of py-spy's raw output; a process's command
    line may hold newlines, which end no sample."""
    pending = ""
    for raw in open(path):
        pending += raw.rstrip("\n")
        if not re.search(r" \d+$", pending):
            pending += " "
            continue
        stack, _, count = pending.rpartition(" ")
        pending = ""
        parts = stack.split(";")
        yield ([p for p in parts if p.startswith("process ")], [p for p in parts if not p.startswith("process ")],
               int(count))


def kind_of(processes: list[str]) -> str:
    meshtrain = sum("-m meshtrain" in p for p in processes)
    if meshtrain >= 2:
        return "a rank started by meshtrain's launcher"
    if meshtrain == 1:
        return "a meshtrain command (launcher or one rank)"
    if any("forkserver" in p for p in processes):
        return "a test's rank (forked from the preloaded server)"
    if len(processes) <= 2:
        return "a pytest worker (references, in-process commands)"
    return "another program (torchrun, examples, ...)"


def doing(frames: list[str]) -> str:
    if any("_find_and_load" in f for f in frames):
        return "importing"
    if any(f.startswith("_compile (torch/_dynamo/convert_frame.py") for f in frames):
        return "compiling"
    return "the rest"


def imported(frames: list[str]) -> str:
    """The outermost library module being imported (torch's to its subpackage), or meshtrain's
    own when it imports nothing else."""
    start = next(i for i, f in enumerate(frames) if "_find_and_load" in f)
    found = [m.group(1) for f in frames[start:] if (m := re.match(r"<module> \(([^:]+)", f))
             and not re.search(r"(^|/)(test_\w+|helpers|distributed|mutant_harness)\.py$", m.group(1))]
    outside = [m for m in found if not m.startswith(("meshtrain/", "examples/"))]
    if not found:
        return "?"
    parts = (outside or found)[0].split("/")
    return "/".join(parts[:2]) if parts[0] in ("torch", "meshtrain") and len(parts) > 2 else parts[0]


def report(path: str, top: int = 8) -> str:
    shares, modules, total = Counter(), {}, 0
    for processes, frames, n in samples(path):
        total += n
        kind, what = kind_of(processes), doing(frames)
        shares[kind, what] += n
        if what == "importing":
            modules.setdefault(kind, Counter())[imported(frames)] += n
    kinds = Counter()
    for (kind, _), n in shares.items():
        kinds[kind] += n
    lines = [f"{total} samples", "", "| process | all | importing | compiling | the rest |", "|---|---|---|---|---|"]
    for kind, n in kinds.most_common():
        cells = [f"{100 * shares[kind, what] / total:.1f} %" for what in ("importing", "compiling", "the rest")]
        lines.append(f"| {kind} | {100 * n / total:.1f} % | " + " | ".join(cells) + " |")
    for kind, counts in modules.items():
        lines += ["", f"imported in {kind}: " + ", ".join(f"{m} {100 * n / total:.1f} %"
                                                         for m, n in counts.most_common(top))]
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 8))

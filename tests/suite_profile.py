"""Where the suite's time goes (`MESHTRAIN_TEST_PROFILE=FILE pytest`, see conftest.py): per test, its wall
time and the time and count of the fresh interpreters it started — subprocesses, from their
start to their exit being read, overlapping ones counted once. One JSON line per test, so
that xdist's workers can append to one file. `python tests/suite_profile.py FILE [N]` prints
the per-file table and the N slowest tests (docs/tests.md's tables)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import defaultdict


class Profile:
    def __init__(self, path: str):
        self.out = open(path, "a")
        self.children: list[list[float | None]] = []  # [start, end] of each subprocess of the current test
        self.t0 = None
        self._time_subprocesses()

    def _time_subprocesses(self) -> None:
        init, reaped = subprocess.Popen.__init__, subprocess.Popen._handle_exitstatus
        children = self.children

        def timed_init(popen, *args, **kwargs):
            popen._profile_span = [time.perf_counter(), None]
            children.append(popen._profile_span)
            init(popen, *args, **kwargs)

        def timed_exit(popen, *args, **kwargs):
            span = getattr(popen, "_profile_span", None)
            if span is not None and span[1] is None:
                span[1] = time.perf_counter()
            return reaped(popen, *args, **kwargs)

        subprocess.Popen.__init__, subprocess.Popen._handle_exitstatus = timed_init, timed_exit

    def pytest_runtest_setup(self, item):
        self.children.clear()
        self.t0 = time.perf_counter()

    def pytest_runtest_makereport(self, item, call):
        if call.when == "teardown" and self.t0 is not None:
            now = time.perf_counter()
            self.out.write(json.dumps({"test": item.nodeid, "wall": round(now - self.t0, 3),
                                       "subprocess": round(_union(self.children, now), 3),
                                       "interpreters": len(self.children), "ended": round(time.time(), 1),
                                       "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}) + "\n")
            self.out.flush()
            self.t0 = None


def _union(spans, now: float) -> float:
    total, last = 0.0, None
    for s, e in sorted((s, e if e is not None else now) for s, e in spans):
        if last is None or s > last:
            total, last = total + e - s, e
        elif e > last:
            total, last = total + e - last, e
    return total


def table(path: str, top: int = 40) -> str:
    rows = [json.loads(line) for line in open(path)]
    per_file = defaultdict(lambda: [0, 0.0, 0.0, 0])
    for r in rows:
        f = per_file[r["test"].split("::")[0]]
        f[0] += 1
        f[1] += r["wall"]
        f[2] += r["subprocess"]
        f[3] += r["interpreters"]
    total = sum(f[1] for f in per_file.values())
    inside = sum(f[2] for f in per_file.values())
    lines = [f"{len(rows)} tests, {total / 60:.1f} min in tests, {inside / 60:.1f} min of it in "
             f"{sum(f[3] for f in per_file.values())} fresh interpreters", ""]
    last = {}  # each xdist worker's last test: how long one waited, idle, for the other to end
    for r in rows:
        if "ended" in r:
            last[r["worker"]] = max(last.get(r["worker"], 0.0), r["ended"])
    if len(last) > 1:
        lines += [f"the workers ended {max(last.values()) - min(last.values()):.0f} s apart", ""]
    lines += [
             "| file | tests | wall s | in fresh interpreters s | interpreters |", "|---|---|---|---|---|"]
    for name, (n, wall, sub, interp) in sorted(per_file.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| {name} | {n} | {wall:.0f} | {sub:.0f} | {interp} |")
    lines += ["", "| test | wall s | in fresh interpreters s | interpreters |", "|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: -r["wall"])[:top]:
        lines.append(f"| {r['test']} | {r['wall']:.1f} | {r['subprocess']:.1f} | {r['interpreters']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40))

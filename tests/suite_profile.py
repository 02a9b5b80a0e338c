"""Per-test profile of the suite (`pytest -p suite_profile`, writes MESHTRAIN_PROFILE or
suite-profile.jsonl): wall time, and the time and count of fresh interpreters the test
started (subprocesses, from their start to their exit being read; overlapping ones counted
once). docs/tests.md's table comes from it (`python tests/suite_profile.py FILE`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import defaultdict

_children: list[list[float]] = []  # [start, end] of each subprocess of the current test


def _patch_popen():
    init, handle = subprocess.Popen.__init__, subprocess.Popen._handle_exitstatus

    def timed_init(self, *a, **k):
        self._profile_span = [time.perf_counter(), None]
        _children.append(self._profile_span)
        init(self, *a, **k)

    def timed_exit(self, *a, **k):
        span = getattr(self, "_profile_span", None)
        if span is not None and span[1] is None:
            span[1] = time.perf_counter()
        return handle(self, *a, **k)

    subprocess.Popen.__init__, subprocess.Popen._handle_exitstatus = timed_init, timed_exit


def _union(spans, now):
    total, last = 0.0, None
    for s, e in sorted((s, e if e is not None else now) for s, e in spans):
        if last is None or s > last:
            total += e - s
            last = e
        elif e > last:
            total += e - last
            last = e
    return total


_patch_popen()
_out = None


def pytest_configure(config):
    global _out
    _out = open(os.environ.get("MESHTRAIN_PROFILE", "suite-profile.jsonl"), "a")


def pytest_runtest_protocol(item, nextitem):
    _children.clear()
    item._profile_t0 = time.perf_counter()


def pytest_runtest_logfinish(nodeid, location):
    pass


def pytest_runtest_teardown(item, nextitem):
    pass


def pytest_runtest_makereport(item, call):
    if call.when == "teardown" and hasattr(item, "_profile_t0"):
        now = time.perf_counter()
        _out.write(json.dumps({"test": item.nodeid, "wall": round(now - item._profile_t0, 3),
                               "subprocess": round(_union(_children, now), 3),
                               "interpreters": len(_children)}) + "\n")
        _out.flush()


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
    lines = [f"{len(rows)} tests, {total / 60:.1f} min in tests", "",
             "| file | tests | wall s | in fresh interpreters s | interpreters |", "|---|---|---|---|---|"]
    for name, (n, wall, sub, interp) in sorted(per_file.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| {name} | {n} | {wall:.0f} | {sub:.0f} | {interp} |")
    lines += ["", "| test | wall s | in fresh interpreters s | interpreters |", "|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: -r["wall"])[:top]:
        lines.append(f"| {r['test']} | {r['wall']:.1f} | {r['subprocess']:.1f} | {r['interpreters']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40))

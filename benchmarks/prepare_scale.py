"""`meshtrain prepare` on generated corpora of 100 MB and 200 MB (.jsonl, made-up words from
a fixed vocabulary of 20,000, Zipf-distributed, documents of 20 to 2,000 words; the same
bytes on every run; `--formats parquet`: the same documents as a Parquet file, row groups
of 2,048 rows), each with --workers 1 and 2 interleaved `--reps` times (the machine is
shared) and each tokenizer asked for: wall time, the tokenize pass's tokens/s (prepare's
own line), peak resident memory (the largest process of its tree: the rusage of a small
process that starts prepare, which holds its children's maxima; and the sum over the tree,
sampled every 50 ms from /proc), and whether the ids of 1 and 2 workers are the same bytes
(sha256 of every token and boundary file). One JSON line a run, appended to
benchmarks/results/prepare_scale.jsonl.

    python benchmarks/prepare_scale.py [--sizes-mb 100 200] [--workers 1 2] [--tokenizers bytes bpe4096]
                                       [--formats jsonl parquet] [--reps 1]
"""

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results" / "prepare_scale.jsonl"
TOKENIZERS = {"bytes": ["--vocab-size", "256"], "bpe4096": ["--vocab-size", "4096"]}


def generate(path: Path, megabytes: int, seed: int = 0) -> None:
    """`megabytes` MB of JSON lines {"text": ...}, deterministic from `seed`: made-up words
    (2 to 9 letters) drawn Zipf-like, so that a BPE has something to learn; the first 100 MB
    of a larger corpus are the 100 MB corpus."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    words = ["".join(rng.choice(letters, size=n)) for n in rng.integers(2, 10, size=20_000)]
    weights = 1.0 / np.arange(1, len(words) + 1)
    weights /= weights.sum()
    target, written = megabytes * 10**6, 0
    with open(path, "w") as f:
        while written < target:
            picks = rng.choice(len(words), size=int(rng.integers(20, 2000)), p=weights)
            line = json.dumps({"text": " ".join(words[i] for i in picks) + ".\n"}) + "\n"
            f.write(line)
            written += len(line)


def as_parquet(jsonl: Path) -> Path:
    """The documents of `jsonl` as a Parquet file beside it (one "text" column), written by a
    process of its own: this one stays small, so it cannot count in a run's peak memory."""
    path = jsonl.with_suffix(".parquet")
    subprocess.run([sys.executable, "-c", "import sys, pyarrow.json as j, pyarrow.parquet as q; "
                    "q.write_table(j.read_json(sys.argv[1]), sys.argv[2], row_group_size=2048)", str(jsonl), str(path)],
                   check=True)
    return path


def _tree(pid: int) -> list[int]:
    """`pid` and every process below it."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out


def _rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


# Starts prepare and prints, at its end, the largest resident set of any process of its tree:
# a process of its own, small, since a child's ru_maxrss counts what it was forked from.
MEASURE = ("import resource, subprocess, sys\n"
           "code = subprocess.call(sys.argv[1:])\n"
           "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)\n"
           "sys.exit(code)")


def run(data: Path, out: Path, flags: list[str], workers: int) -> dict:
    """One `meshtrain prepare`, its time, rate and memory."""
    cmd = [sys.executable, "-m", "meshtrain", "prepare", "--data", str(data), "--out", str(out), "--workers",
           str(workers), *flags]
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", MEASURE, *cmd], stderr=subprocess.PIPE, text=True)
    peak_tree, done = [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak_tree[0] = max(peak_tree[0], sum(_rss_kib(p) for p in _tree(proc.pid)[1:]))
            time.sleep(0.05)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    err = proc.stderr.read()
    proc.wait()
    wall = time.perf_counter() - t0
    done.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err}")
    rate = re.search(r"in ([\d.]+) s: ([\d,]+) tokens/s", err)
    meta = json.loads((out / "meta.json").read_text())
    return {"n_tokens": meta["n_tokens"], "documents": meta["documents"], "wall_s": round(wall, 2),
            "tokenize_s": float(rate.group(1)), "tokens_per_s": int(rate.group(2).replace(",", "")),
            "peak_rss_mib_largest_process": round(int(err.strip().splitlines()[-1]) / 1024, 1),
            "peak_rss_mib_process_tree": round(peak_tree[0] / 1024, 1), "ids_sha256": ids_sha256(out, meta)}


def ids_sha256(folder: Path, meta: dict) -> str:
    h = hashlib.sha256()
    for shard in meta["shards"]:
        for name in (shard["tokens"], shard["documents"]):
            with open(folder / name, "rb") as f:
                for block in iter(lambda: f.read(1 << 24), b""):
                    h.update(block)
    return h.hexdigest()


def compare(data: Path, fmt: str, tok: str, args, tmp: Path) -> None:
    """The worker counts on one corpus and tokenizer, interleaved `args.reps` times: a JSON
    line each, printed and appended to the results."""
    rows = []
    for rep in range(args.reps):
        for w in args.workers:
            out = tmp / f"out-{tok}-{w}"
            rows.append({"bench": "prepare_scale", "corpus_mb": round(data.stat().st_size / 1e6, 1), "format": fmt,
                         "tokenizer": tok, "workers": w, "rep": rep, "cpus": os.cpu_count(),
                         **run(data, out, TOKENIZERS[tok], w)})
            subprocess.run(["rm", "-rf", str(out)], check=True)
    same = len({r["ids_sha256"] for r in rows}) == 1
    for r in rows:
        r["ids_same_across_workers"] = same
        print(json.dumps(r), flush=True)
        with open(RESULTS, "a") as f:
            f.write(json.dumps(r) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[100, 200])
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokenizers", nargs="+", default=list(TOKENIZERS), choices=list(TOKENIZERS))
    ap.add_argument("--formats", nargs="+", default=["jsonl"], choices=["jsonl", "parquet"])
    ap.add_argument("--reps", type=int, default=1)
    args = ap.parse_args()
    RESULTS.parent.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for mb in args.sizes_mb:
            jsonl = Path(tmp) / f"corpus-{mb}mb.jsonl"
            generate(jsonl, mb)
            for fmt in args.formats:
                data = jsonl if fmt == "jsonl" else as_parquet(jsonl)
                for tok in args.tokenizers:
                    compare(data, fmt, tok, args, Path(tmp))
                if data != jsonl:
                    data.unlink()
            jsonl.unlink()


if __name__ == "__main__":
    main()

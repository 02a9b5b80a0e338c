"""The end of a command-line run of a 100M-parameter GPT (issue 49): the most each rank holds,
by the live-storage meter, while the final weights stream to rank 0's file and while the
sharded job samples the text (`tests/test_end_of_run.py`'s `_end_of_run`, one training step
first), beside the model's largest tensor and its whole size. One JSON line per (layout, rank).

    python benchmarks/end_of_run.py --out benchmarks/results/end_of_run.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

LAYOUTS = {"dp2": (["--dp", "2"], {}), "tp2": (["--tp", "2"], {"tp": 2}), "pp2": (["--pp", "2"], {"pp": 2})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--sample-tokens", type=int, default=8)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    __import__("conftest")  # the tests' preloaded rank server and settings
    from distributed import run_ranks
    from helpers import cli_config
    from test_end_of_run import _end_of_run

    from meshtrain.models.specs import GPTSpec
    preset = ("gpt-100m", GPTSpec(n_layers=14, n_heads=12, d_model=768, max_seq_len=1024))
    from meshtrain.recipes import add_preset
    add_preset(*preset)
    lines = []
    for name in args.layouts:
        flags, axes = LAYOUTS[name]
        with tempfile.TemporaryDirectory() as out:
            cfg = cli_config("train", "--model", preset[0], "--vocab-size", "256", "--seq-len", "64", "--batch-size",
                             "2", "--device", "cpu", "--steps", "1", *flags, "--out", out)
            cfg.train.sample_tokens = args.sample_tokens
            for rank, r in enumerate(run_ranks(_end_of_run, 2, cfg, [preset], timeout=1800, **axes)):
                line = {"layout": name, "rank": rank, **{k: r[k] for k in ("streaming", "sampling", "one_forward",
                                                                            "largest", "total")}}
                print(json.dumps(line), flush=True)
                lines.append(line)
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)


if __name__ == "__main__":
    main()

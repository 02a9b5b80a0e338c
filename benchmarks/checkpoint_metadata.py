"""The metadata a save and a load exchange (issue 49): the bytes each rank receives from
meshtrain's own exchanges and from torch DCP's, at each world size, measured on real gloo ranks
as `tests/test_checkpoint_metadata_bytes.py` measures them (its `measured`: torch's tensor
collectives counted in the ranks), for the exchanges as they are and as they were (everything
all-gathered to every rank: the test's mutant). One JSON line per (world, rank), then rank 0's
and rank 1's figures extrapolated to `--to` ranks.

The extrapolation fits a + b/n + c·n through the three largest worlds measured (a + c·n
through two): each exchange is a fixed part (a verdict, a broadcast index), a part that the
ranks divide between them (DCP's deduplicated save plan, scattered: 1/n of it each under data
parallelism) and a part per rank (what a gather brings to its root; the sizes torch's object
collectives all-gather, 8 bytes a rank).

    python benchmarks/checkpoint_metadata.py --model moe-48 --worlds 2 4 8 \
        --out benchmarks/results/checkpoint_metadata.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def lines(model: str, worlds: list[int], to: int) -> list[dict]:
    from test_checkpoint_metadata_bytes import measured
    with tempfile.TemporaryDirectory() as tmp:
        got = measured(tmp, tuple(worlds), model)
    out = []
    for n, ranks in got.items():
        for rank, cases in enumerate(ranks):
            out.append({"model": model, "world": n, "rank": rank,
                        **{f"{case}/{phase}/{owner}": b for case, phases in cases.items()
                           for phase, owners in phases.items() for owner, b in owners.items()
                           if case == "now" or owner == "meshtrain"}})  # the mutant changes none of DCP's
    fitted = sorted(worlds)[-3:]
    basis = (lambda n: [1.0, 1.0 / n, float(n)]) if len(fitted) == 3 else (lambda n: [1.0, float(n)])
    for rank, who in ((0, "rank 0"), (1, "other ranks")):
        at = {n: next(r for r in out if r["world"] == n and r["rank"] == rank) for n in fitted}
        keys = [k for k in at[fitted[0]] if "/" in k]
        coefficients = numpy.linalg.solve(numpy.array([basis(n) for n in fitted]),
                                          numpy.array([[at[n][k] for k in keys] for n in fitted], dtype=float))
        out.append({"model": model, "world": to, "who": who, "extrapolated_from": fitted,
                    **dict(zip(keys, (round(v) for v in numpy.array(basis(to)) @ coefficients)))})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="moe-48", choices=["layers", "moe-48"])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--to", type=int, default=4096)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    found = lines(args.model, args.worlds, args.to)
    text = "".join(json.dumps(line) + "\n" for line in found)
    print(text, end="")
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()

"""Resuming in another layout: gpt-test trained 8 steps uninterrupted in one layout, against
the same run stopped after its step-4 checkpoint and resumed in another layout (another world
size too). Reported: the worst relative difference of the resumed steps' losses and of each
tensor's update from the initial weights (verify's measures and tolerances), and whether the
same-layout resume is bitwise.

    python benchmarks/resume_layouts.py --out benchmarks/results/resume_layouts.json"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

PAIRS = [({"dp": 2}, {"tp": 2}), ({"dp": 2, "zero": 3}, {"pp": 2, "schedule": "1f1b", "microbatches": 2}),
         ({"tp": 2, "sp": True}, {"dp": 4, "zero": 2}),
         ({"pp": 2, "schedule": "interleaved", "chunks": 2, "microbatches": 2}, {"dp": 2, "tp": 2}),
         ({"dp": 2, "zero": 1}, {})]


def _name(layout: dict) -> str:
    parts = [f"{k}{v}" for k, v in layout.items() if k in ("dp", "tp", "pp") and v > 1]
    parts += [f"zero{layout['zero']}"] if layout.get("zero") else []
    parts += ["sp"] if layout.get("sp") else []
    parts += [layout["schedule"]] if "schedule" in layout else []
    return "·".join(parts) or "one process"


def main() -> None:
    from distributed import run_ranks
    from test_checkpoint import CPU, SAVED_AT, _cfg, _interrupted, _resumed, _run, _world

    from meshtrain.mesh import Mesh

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = []
    for saved, resumed in PAIRS:
        with tempfile.TemporaryDirectory() as folder:
            (losses, weights), start = run_ranks(_interrupted, _world(saved), saved, folder, pp=saved.get("pp", 1),
                                                 tp=saved.get("tp", 1), timeout=600)[0]
            if _world(resumed) == 1:
                cfg = _cfg(resumed, folder)
                cfg.train.resume = True
                got_losses, got = _run(cfg, Mesh.single(CPU))
            else:
                got_losses, got = run_ranks(_resumed, _world(resumed), resumed, folder, pp=resumed.get("pp", 1),
                                            tp=resumed.get("tp", 1), timeout=600)[0]
        loss_rel = max(abs(a - b) / abs(b) for a, b in zip(got_losses, losses[SAVED_AT:]))
        worst = max(((float((got[n] - start[n] - (w - start[n])).norm() / max((w - start[n]).norm(), 1e-30)), n)
                     for n, w in weights.items()))
        rows.append({"saved": _name(saved), "resumed": _name(resumed), "max_loss_rel_diff": loss_rel,
                     "max_update_rel_diff": worst[0], "worst_tensor": worst[1]})
        print(f"{rows[-1]['saved']} -> {rows[-1]['resumed']}: losses {loss_rel:.2e}, updates {worst[0]:.2e} "
              f"({worst[1]})", flush=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

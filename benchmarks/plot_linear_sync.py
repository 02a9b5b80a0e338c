"""The linear-sync sweep's figure and README table: per dp, the dp bytes each rank sends per
step and the median step time against the global batch, for allreduce, allgather, auto (and
torch DDP's time), with each layer's predicted crossover marked."""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STYLES = {"allreduce": "o-", "allgather": "s-", "auto": "^--", "ddp": "x:"}


def table(result: dict) -> str:
    """Markdown rows: B, bytes (kB) and times (ms) of each set-up, auto's choice per layer."""
    lines = [f"dp = {result['dp']}", "",
             "| B | all-reduce kB | all-gather kB | auto kB | all-reduce ms | all-gather ms | auto ms | DDP ms | auto's choice |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for p in result["points"]:
        b, t = p["dp_bytes_per_step"], p["step_time_median_s"]
        choice = " ".join("G" if c == "allgather" else "R" for c in p["auto_choices"].values())
        lines.append(f"| {p['batch']} | {b['allreduce'] / 1e3:,.0f} | {b['allgather'] / 1e3:,.0f} | "
                     f"{b['auto'] / 1e3:,.0f} | {t['allreduce'] * 1e3:.1f} | {t['allgather'] * 1e3:.1f} | "
                     f"{t['auto'] * 1e3:.1f} | {t['ddp'] * 1e3:.1f} | {choice} |")
    return "\n".join(lines)


def measured_crossover(result: dict, key: str) -> int | None:
    """The smallest swept B at which all-gather is no longer below all-reduce (bytes or time)."""
    for p in result["points"]:
        values = p[key]
        if values["allgather"] >= values["allreduce"]:
            return p["batch"]
    return None


def whole_model_crossover(result: dict) -> float:
    """B below which gathering every layer sends fewer bytes than all-reducing every layer:
    2·Σ(n_in + 1)·n_out / Σ(n_in + n_out)."""
    shapes = [tuple(int(w) for w in layer.split("→")) for layer in result["predicted_crossover"]]
    return 2 * sum((a + 1) * b for a, b in shapes) / sum(a + b for a, b in shapes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+")
    parser.add_argument("--png", required=True)
    args = parser.parse_args()
    results = [json.load(open(path)) for path in args.results]
    fig, axes = plt.subplots(2, len(results), figsize=(6 * len(results), 8), squeeze=False)
    for col, r in enumerate(results):
        batches = [p["batch"] for p in r["points"]]
        for row, (key, scale, label) in enumerate([("dp_bytes_per_step", 1e-6, "dp MB sent per step and rank"),
                                                   ("step_time_median_s", 1e3, "median step time (ms)")]):
            ax = axes[row][col]
            for name, style in STYLES.items():
                if name in r["points"][0][key]:
                    ax.plot(batches, [p[key][name] * scale for p in r["points"]], style, label=name)
            for layer, b in r["predicted_crossover"].items():
                ax.axvline(b, color="grey", lw=0.8, ls=":")
                ax.text(b, ax.get_ylim()[1], f" {layer}", rotation=90, va="top", fontsize=7, color="grey")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("global batch B (rows)")
            ax.set_ylabel(label)
            ax.set_title(f"MLP 64→{r['hidden'].replace(',', '→')}→10, dp = {r['dp']}")
            ax.legend(fontsize=8)
        print(table(r))
        print(f"\nmeasured crossover of the whole model (first swept B where all-gather is not below all-reduce): "
              f"bytes {measured_crossover(r, 'dp_bytes_per_step')} (predicted B < {whole_model_crossover(r):.0f}), "
              f"time {measured_crossover(r, 'step_time_median_s')}; predicted per layer: "
              + ", ".join(f"{k} B < {v:.0f}" for k, v in r["predicted_crossover"].items()) + "\n")
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()

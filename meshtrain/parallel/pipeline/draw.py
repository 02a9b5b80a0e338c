"""What `meshtrain schedule` shows: the simulator's timeline as text (one row per stage, one
cell per time unit), as a picture, and as the contract's JSON."""

from __future__ import annotations

from fractions import Fraction

from meshtrain.parallel.pipeline.simulate import Simulation

COLOURS = {"F": "#4c72b0", "B": "#55a868", "W": "#dd8452"}


def _label(span, chunks: int) -> str:
    return f"{span.kind}{span.op.mb}" + (f"/{span.op.chunk}" if chunks > 1 else "")


def text_timeline(sim: Simulation, unit=None) -> str:
    """Each stage a row; a cell per `unit` of time (default 1/chunks, exact for the default
    costs; measured timelines are rounded to it) holds the instruction running then (F forward,
    B backward, W weight gradient, then the micro-batch, then /chunk), '.' idle."""
    unit = unit or Fraction(1, sim.chunks)
    cells = round(sim.makespan / unit)
    labels = [_label(sp, sim.chunks) for sp in sim.spans]
    width = max([len(lab) for lab in labels] + [1]) + 1
    rows = []
    for stage in range(sim.stages):
        row = ["." .ljust(width)] * cells
        for sp, lab in zip(sim.spans, labels):
            if sp.stage == stage:
                for c in range(round(sp.start / unit), round(sp.end / unit)):
                    row[c] = lab.ljust(width)
        rows.append(f"stage {stage}: " + "".join(row).rstrip())
    return "\n".join(rows)


def summary(name: str, microbatches: int, sim: Simulation) -> dict:
    """The contract's JSON for `meshtrain schedule`."""
    return {
        "schedule": name, "pp": sim.stages, "microbatches": microbatches, "chunks": sim.chunks,
        "makespan": float(sim.makespan), "bubble_fraction": float(sim.bubble_fraction),
        "peak_inflight": sim.peak_inflight,
        "timeline": [{"stage": sp.stage, "start": float(sp.start), "end": float(sp.end), "op": sp.kind,
                      "mb": sp.op.mb, "chunk": sp.op.chunk} for sp in sim.spans],
    }


def draw_png(sim: Simulation, path: str, title: str) -> None:
    draw_panels([(sim, title)], path, "time (forward = 1)", width=max(6.0, float(sim.makespan) * 0.35))


def draw_panels(panels: list[tuple[Simulation, str]], path: str, xlabel: str, width: float = 9.0) -> None:
    """Timelines one above the other on one time axis (a prediction over a measurement)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = panels[0][0].stages
    fig, axes = plt.subplots(len(panels), 1, sharex=True, squeeze=False,
                             figsize=(width, (0.6 * stages + 1.0) * len(panels) + 0.6))
    for (sim, title), ax in zip(panels, axes[:, 0]):
        _draw(ax, sim, title)
    axes[-1, 0].set_xlabel(xlabel)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    axes[-1, 0].legend(handles, ["forward", "backward (zb: input gradient)", "weight gradient (zb)"], fontsize=7,
                       ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.3 - 0.1 / stages), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _draw(ax, sim: Simulation, title: str) -> None:
    for sp in sim.spans:
        start, length = float(sp.start), float(sp.end - sp.start)
        shade = 1.0 - 0.35 * sp.op.chunk / max(1, sim.chunks - 1) if sim.chunks > 1 else 1.0
        ax.broken_barh([(start, length)], (sp.stage - 0.4, 0.8), facecolors=COLOURS[sp.kind], alpha=shade,
                       edgecolor="white")
        ax.text(start + length / 2, sp.stage, str(sp.op.mb), ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(sim.stages), [f"stage {s}" for s in range(sim.stages)])
    ax.invert_yaxis()
    ax.set_title(f"{title}: bubble {float(sim.bubble_fraction):.1%}" + (" (lighter: later chunks)" if sim.chunks > 1
                                                                       else ""))

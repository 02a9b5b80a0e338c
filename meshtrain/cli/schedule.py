"""`meshtrain schedule`: a pipeline schedule's timeline, bubble and peak of micro-batches in
flight, simulated (no processes, no data); or, with --trace, the simulator fed with a real
run's measured costs against that run."""

from __future__ import annotations

import sys
from pathlib import Path

from meshtrain.parallel.pipeline.draw import draw_panels, draw_png, summary, text_timeline
from meshtrain.parallel.pipeline.schedules import schedule
from meshtrain.parallel.pipeline.simulate import simulate


def run(args) -> int:
    """`meshtrain schedule`: no processes, no data; the simulator and what draws it."""
    import json

    if args.trace:
        return _schedule_against_trace(args)
    p, m, v = args.pp, args.microbatches, args.chunks
    try:
        if p is None or m is None:
            raise ValueError("give --pp and --microbatches (or --trace FILE from `meshtrain train --trace`)")
        for flag, value in (("--pp", p), ("--microbatches", m), ("--chunks", v)):
            if value < 1:
                raise ValueError(f"{flag} {value}: must be a positive integer")
        lists = schedule(args.schedule, p, m, v)
    except ValueError as e:
        print(f"meshtrain: error: {e}", file=sys.stderr)
        return 2
    out = sys.stderr if args.json else sys.stdout
    if m < p:
        print(f"meshtrain: warning: {m} micro-batches for {p} stages: some stages idle through most of the step; "
              f"use --microbatches {p} or more", file=sys.stderr)
    sim = simulate(lists, v, microbatches=m)
    title = f"{args.schedule}, p={p}, m={m}" + (f", v={v}" if v > 1 else "")
    print(f"{title}: F forward, B backward, W weight gradient; micro-batch" + (" / chunk" if v > 1 else ""), file=out)
    print(text_timeline(sim), file=out)
    print(f"makespan {float(sim.makespan):g}, bubble_fraction {float(sim.bubble_fraction):.4f}, "
          f"peak_inflight {sim.peak_inflight}", file=out)
    if args.png:
        draw_png(sim, args.png, title)
        print(f"wrote {args.png}", file=out)
    if args.json:
        print(json.dumps(summary(args.schedule, m, sim)), flush=True)
    return 0


def _schedule_against_trace(args) -> int:
    """`meshtrain schedule --trace FILE`: the simulator fed with a real run's measured costs,
    against that run: makespans, order of operations, both timelines."""
    import json

    from meshtrain.parallel.pipeline.trace import compare

    try:
        trace = json.loads(Path(args.trace).read_text())
        result = compare(trace)
    except OSError as e:
        print(f"meshtrain: error: --trace {args.trace}: cannot read it ({e.strerror or e})", file=sys.stderr)
        return 2
    except (ValueError, KeyError, TypeError) as e:
        print(f"meshtrain: error: --trace {args.trace}: not a trace written by `meshtrain train --trace` ({e!r})",
              file=sys.stderr)
        return 2
    out = sys.stderr if args.json else sys.stdout
    predicted, measured = result.pop("predicted"), result.pop("measured")
    forwards = [sp.end - sp.start for sp in measured.spans if sp.kind == "F"]
    unit = min(forwards) if forwards else measured.makespan / 40
    title = f"{trace['model']}, {trace['layout']}"
    for name, sim in (("measured (median step)", measured), ("simulated from measured costs", predicted)):
        print(f"{name}, one cell = {unit * 1e3:.1f} ms:", file=out)
        print(text_timeline(sim, unit), file=out)
    print(f"makespan: simulated {result['predicted_makespan_s'] * 1e3:.1f} ms, measured "
          f"{result['measured_makespan_s'] * 1e3:.1f} ms (median of {len(trace['steps']) - 1 or 1} steps), "
          f"ratio {result['predicted_over_measured']:.3f}; p2p {trace['p2p_s'] * 1e3:.2f} ms per transfer; "
          f"same order of operations on every stage: {'yes' if result['same_order'] else 'NO'}", file=out)
    for stage, ops in enumerate(result["op_median_s_per_stage"]):
        print(f"stage {stage}, median ms: " + ", ".join(f"{k} {t * 1e3:.1f}" for k, t in ops.items()), file=out)
    if args.png:
        draw_panels([(measured, f"measured: {title}"), (predicted, "simulated from the measured costs")], args.png,
                    "seconds from the step's start")
        print(f"wrote {args.png}", file=out)
    if args.json:
        print(json.dumps(result), flush=True)
    return 0

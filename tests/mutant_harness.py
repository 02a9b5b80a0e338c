"""What the verify-mutant tests share: in spawned ranks, the real code's verify record in each
layout, then each mutant's (its patches applied inside the ranks only, so the one-process
reference the parent computes is the real code), and the verdicts against that reference."""

from contextlib import ExitStack

from meshtrain import verifier as verify
from meshtrain.comm import Comm


def records_of_every_mutant(mesh, layouts: list[str], configs: dict, mutants: dict) -> dict:
    """{name: (layout, record)} for "real LAYOUT" of each of `layouts` and each mutant of
    `mutants` ({name: (patches(), layout)}) whose layout is among them."""
    records = {f"real {layout}": (layout, verify.record(configs[layout], Comm(mesh), "real")) for layout in layouts}
    for name, (mutant, layout) in mutants.items():
        if layout in layouts:
            with ExitStack() as stack:
                for patch in mutant():
                    stack.enter_context(patch)
                records[name] = (layout, verify.record(configs[layout], Comm(mesh), name))
    return records


def assert_real_passes(verdicts: dict, layout: str) -> None:
    real = verdicts[f"real {layout}"]
    assert real["passed"], real["failures"]


def assert_mutant_fails(verdicts: dict, name: str) -> None:
    assert not verdicts[name]["passed"], f"{name} slipped through verify"


def verdicts_of(records: dict, configs: dict) -> dict:
    """{name: verify's verdict} of each record against the one-process reference. The
    reference's own trajectory depends only on its one-process configuration and the sampled
    steps: it is computed once for all the layouts that share them (dp, ZeRO, all-gather and
    compile alike), and each record gets its own lockstep steps."""
    trajectories = {}
    verdicts = {}
    for name, (layout, rec) in records.items():
        key = (repr(verify.reference_config(configs[layout])), tuple(sorted(rec["steps"])))
        if key not in trajectories:
            trajectories[key] = verify.reference_trajectory(configs[layout], list(key[1]))
        verdicts[name] = verify.compare(rec, verify.run_reference(configs[layout], rec, trajectories[key]))
    return verdicts

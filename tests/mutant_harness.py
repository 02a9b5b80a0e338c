"""What the verify-mutant tests share: in spawned ranks, the real code's verify record in each
layout, then each mutant's (its patches applied inside the ranks only, so the one-process
reference the parent computes is the real code), and the verdicts against that reference."""

from contextlib import ExitStack

from helpers import verdict

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
    """{name: verify's verdict} of each record against the one-process reference (its
    trajectory computed once for every layout that shares it: `helpers.verdict`)."""
    return {name: verdict(configs[layout], rec) for name, (layout, rec) in records.items()}

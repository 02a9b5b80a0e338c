"""A model family of a user's own (tests/families/minefam.py: a model, a TP plan, a pipeline
plan, a preset) reached by its preset's name from the command line — through an entry point
of the group `meshtrain.recipes`, as a package declares it — and trained under tp 2 and pp 2
by `meshtrain verify` against one process, with no file of meshtrain edited. A fresh command
and its ranks load the entry point in `test_a_registered_family_verifies_under_tp_and_pp[tp2]`;
the other cases read it in this process (`plugin_here`) and in ranks forked from the
preloaded server with the site on their path."""

import os
import sys
from pathlib import Path

import pytest

from helpers import cli_config, last_json, run_cli, run_main, verify_in_ranks

FAMILIES = Path(__file__).resolve().parent / "families"
SMALL = ["--vocab-size", "256", "--seq-len", "16", "--batch-size", "8", "--device", "cpu", "--steps", "3"]


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory):
    """A site folder holding the family's module and a dist-info that declares its entry point."""
    site = tmp_path_factory.mktemp("site")
    (site / "minefam.py").write_text((FAMILIES / "minefam.py").read_text())
    info = site / "minefam-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: minefam\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[meshtrain.recipes]\nmixer = minefam:FAMILY\n")
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path}


@pytest.fixture
def on_path(monkeypatch):
    """`on_path(folder)`: this process finds modules (and entry points) in `folder`, as a
    command started with it on PYTHONPATH would; the registry of families and the imported
    `minefam` are put back afterwards."""
    import meshtrain.recipes as R
    saved = [dict(R.FAMILIES), dict(R.PRESETS), dict(R.PUBLISHED)]
    monkeypatch.setattr(R, "_plugins_loaded", False)  # read the entry points again, with folder on the path
    yield lambda folder: monkeypatch.syspath_prepend(str(folder))
    for registry, before in zip((R.FAMILIES, R.PRESETS, R.PUBLISHED), saved):
        registry.clear()
        registry.update(before)
    sys.modules.pop("minefam", None)


def _site(plugin_env) -> str:
    return plugin_env["PYTHONPATH"].split(os.pathsep)[0]


@pytest.mark.parametrize("layout", [["--tp", "2"], ["--pp", "2", "--microbatches", "2"]], ids=["tp2", "pp2"])
def test_a_registered_family_verifies_under_tp_and_pp(plugin_env, on_path, layout):
    """tp 2 as a user runs it (the command and its ranks each load the entry point); pp 2
    through the same calls, the entry point read here and in forked ranks."""
    args = ("verify", "--model", "mixer-test", *layout, *SMALL)
    if "--pp" in layout:
        on_path(_site(plugin_env))
        out = verify_in_ranks(cli_config(*args), paths=[_site(plugin_env)])
    else:
        r = run_cli(*args, "--json", env=plugin_env, fresh=True)  # entry points read by a fresh interpreter
        assert r.returncode == 0, r.stderr[-2000:]
        out = last_json(r.stdout)
    assert out["passed"] and out["max_grad_rel_diff"] < 1e-5 and out["max_update_rel_diff"] < 1e-4, out


def test_the_family_is_validated_and_planned_by_its_own_answers(plugin_env, on_path):
    """Its tensor-parallel splits refuse a tp that does not divide them, before any rank starts;
    the planner, to which the family gives no shape, says so in one line (through the command
    line's `main` in this process, the entry point read here)."""
    on_path(_site(plugin_env))
    r = run_main("train", "--model", "mixer-test", "--tp", "3", *SMALL)
    assert r.returncode == 2 and "--tp 3 does not divide the 64 feed-forward width of mixer-test" in r.stderr, r.stderr
    r = run_main("plan", "--model", "mixer-test")
    assert r.returncode == 2 and "unknown model 'mixer-test' for the planner" in r.stderr, r.stderr


def test_a_name_no_family_registers_is_refused_with_the_presets(on_path):
    r = run_main("train", "--model", "mixer-test", *SMALL)
    assert r.returncode == 2 and "unknown model 'mixer-test'" in r.stderr, r.stderr


def test_a_users_recipe_with_init_is_built_on_meta_and_drawn_per_rank(on_path):
    """`Recipe(init=...)`: the command line's configuration builds the model on the meta
    device and each ZeRO-3 rank draws only its shard; the one-process reference draws the
    same values (the module found on the path, here and in forked ranks)."""
    on_path(FAMILIES)
    out = verify_in_ranks(cli_config("verify", "--model", "minefam:meta_recipe", "--dp", "2", "--zero", "3", *SMALL),
                          paths=[FAMILIES])
    assert out["passed"] and out["max_update_rel_diff"] < 1e-4, out

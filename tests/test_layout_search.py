"""`train --layout-search`: the planner proposes, a profile on the real ranks decides, the run
trains the winner as if it had been given by hand; the measurements are reused by a second
search and by a resumed run; a candidate over the memory budget on any one rank is skipped
by all; bad input is refused before any rank starts. The planner predicts with a synthetic
machine profile here (the ranking it makes is not what these tests check; the benchmark,
benchmarks/layout_search.py, checks the choice against measured layouts)."""

from __future__ import annotations

import json

import pytest

from distributed import run_ranks
from helpers import last_json, run_cli, run_main
from test_planner import _synthetic_profile

RUN = ["--model", "gpt-test", "--batch-size", "4", "--seq-len", "32", "--steps", "3"]
CANDIDATE_KEYS = {"layout", "predicted_step_s", "measured_step_s", "predicted_peak_bytes", "measured_peak_bytes",
                  "skipped"}


@pytest.fixture(scope="module")
def machine(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("machine") / "machine.json"
    _synthetic_profile(path)
    return str(path)


def flags_of(layout: dict) -> list[str]:
    """`train`'s flags for a recorded layout, as a user would give them by hand."""
    flags = []
    for key in ("dp", "tp", "pp", "cp", "cp_mode", "ep", "zero", "schedule", "chunks", "microbatches", "recompute"):
        flags += [f"--{key.replace('_', '-')}", str(layout[key])]
    return flags + (["--sp"] if layout["sp"] else [])


@pytest.fixture(scope="module")
def searched(machine, tmp_path_factory):
    out = tmp_path_factory.mktemp("searched")
    r = run_cli("train", *RUN, "--dropout", "0.1", "--layout-search", "--reprofile", "--machine", machine,
                "--save-every", "3", "--out", out, "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r


def test_the_search_trains_the_fastest_measured_candidate_as_if_given_by_hand(searched, tmp_path):
    out, r = searched
    got = last_json(r.stdout)
    search = got["layout_search"]
    assert len(search["candidates"]) == 3 and all(set(c) == CANDIDATE_KEYS for c in search["candidates"])
    measured = [c["measured_step_s"] for c in search["candidates"]]
    assert None not in measured and search["chosen"] == measured.index(min(measured))
    assert all(c["measured_peak_bytes"] > 0 and c["skipped"] is None for c in search["candidates"])
    assert 0 < search["profile_s"] <= search["search_budget_s"]
    chosen = search["candidates"][search["chosen"]]["layout"]
    assert got["layout"] == {k: chosen[k] for k in got["layout"]}  # the run's layout is the chosen one
    assert json.loads((out / "layout-search.json").read_text()) == search
    assert "profiling 3/3" in r.stderr and "chosen" in r.stderr  # the table (on stderr under --json)
    # The same layout by hand: the same losses to the bit (the profile left no trace).
    by_hand = run_cli("train", *RUN, "--dropout", "0.1", *flags_of(chosen), "--out", tmp_path, "--json")
    assert by_hand.returncode == 0, by_hand.stderr[-2000:]
    assert last_json(by_hand.stdout)["losses"] == got["losses"]
    checked = run_cli("verify", *RUN, "--dropout", "0.1", *flags_of(chosen), "--json")
    assert checked.returncode == 0, checked.stderr[-2000:]  # and it trains the one-process model


def test_a_second_search_reuses_the_measurements_and_a_resume_the_choice(searched, machine, tmp_path):
    out, first = searched
    before = last_json(first.stdout)["layout_search"]
    again = run_cli("train", *RUN, "--dropout", "0.1", "--layout-search", "--machine", machine, "--out", tmp_path,
                    "--json")
    assert again.returncode == 0, again.stderr[-2000:]
    reused = last_json(again.stdout)["layout_search"]
    assert reused["reused"] and "profiling" not in again.stderr
    assert [c["measured_step_s"] for c in reused["candidates"]] == [c["measured_step_s"]
                                                                     for c in before["candidates"]]
    assert reused["chosen"] == before["chosen"]
    resumed = run_cli("train", *RUN[:-1], "5", "--dropout", "0.1", "--layout-search", "--machine", machine,
                      "--resume", "--out", out, "--json")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    got = last_json(resumed.stdout)
    assert got["first_step"] == 4 and got["layout_search"]["resumed"] and "profiling" not in resumed.stderr
    assert got["layout"] == last_json(first.stdout)["layout"]


def test_a_memory_budget_plain_dp_does_not_fit_picks_a_layout_that_does(machine, tmp_path):
    plain = run_cli("train", *RUN, "--dp", "2", "--out", tmp_path / "dp", "--json")
    assert plain.returncode == 0, plain.stderr[-2000:]

    def peaks(got: dict) -> list[int]:
        return [s["total"] + a for s, a in zip(got["model_state_bytes_per_rank"], got["activation_bytes_per_rank"])]
    budget = int(0.8 * max(peaks(last_json(plain.stdout))))
    r = run_cli("train", *RUN, "--layout-search", "--machine", machine, "--memory-per-rank", budget,
                "--out", tmp_path / "searched", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    got = last_json(r.stdout)
    search = got["layout_search"]
    assert all(c["predicted_peak_bytes"] <= budget for c in search["candidates"])
    assert search["candidates"][search["chosen"]]["measured_peak_bytes"] <= budget
    assert max(peaks(got)) <= budget  # the run itself stays under it
    assert not (got["layout"]["dp"] == 2 and got["layout"]["zero"] == 0 and got["layout"]["recompute"] == "none"
                and got["layout"]["microbatches"] == 1)


def _search_with(mesh, cfg, plan):
    from meshtrain.cli.layout_search import config_trial
    from meshtrain.layout_search import search_on_ranks
    return search_on_ranks(plan, mesh.device, config_trial(cfg)).record()


def test_a_candidate_over_the_budget_on_one_rank_is_skipped_on_all(machine, tmp_path):
    """pp 2 with 2 micro-batches: its second stage goes over the budget, its first does not
    (the planner's figures: 2.9 and 3.3 MiB); every rank skips it alike (a rank that went on
    alone would hang), and a candidate the search's time cannot hold is never built."""
    from meshtrain.cli.config import Config
    from meshtrain.cli.workload import preset_workload
    from meshtrain.search_plan import Candidate, SearchPlan
    from meshtrain.parallel.options import Layout
    from meshtrain.plan.planner import Device

    cfg = Config()
    cfg.model.name, cfg.train.batch_size, cfg.train.seq_len, cfg.train.out = "gpt-test", 4, 32, str(tmp_path)
    work = preset_workload(cfg)

    def stage_peaks(lay):
        d = Device(work, lay)
        return [d.model_states(s)["total"] + d.activations(s) for s in range(lay.pp)]
    over, fits = Layout(dp=1, pp=2, microbatches=2), Layout(dp=1, pp=2, microbatches=4)
    budget = sum(stage_peaks(over)) / 2
    assert min(stage_peaks(over)) < budget < max(stage_peaks(over)) and max(stage_peaks(fits)) < 0.95 * budget
    plan = SearchPlan(2, [Candidate(over, 0.01, budget * 0.9), Candidate(fits, 0.02, budget * 0.8),
                          Candidate(Layout(dp=2), 1e4, budget * 0.5)], budget, "test", 60.0, "", 3, 3, "test", 4)
    records = run_ranks(_search_with, 2, cfg, plan, pp=2)
    assert records[0] == records[1]
    over_rec, fits_rec, slow_rec = records[0]["candidates"]
    assert over_rec["skipped"].startswith("measured peak") and over_rec["measured_step_s"] is None
    assert over_rec["measured_peak_bytes"] > budget
    assert fits_rec["skipped"] is None and fits_rec["measured_peak_bytes"] <= budget
    assert slow_rec["skipped"].startswith("out of the search's time") and slow_rec["measured_peak_bytes"] is None
    assert records[0]["chosen"] == 1


@pytest.mark.parametrize("flags, message", [
    (["--memory-per-rank", "1MiB"], "fits no layout of 2 ranks in 1.00 MiB per rank (--memory-per-rank): the "
                                    "closest, "),
    (["--world", "9"], "no layout of 9 ranks runs gpt-test"),
    (["--dp", "2", "--zero", "1", "--recompute", "none", "--microbatches", "1"], "nothing is left to search"),
    (["--search-budget", "1e-6"], "is less than one candidate's warm-up"),
    (["--memory-per-rank", "lots"], "give a size such as 12GiB"),
    (["--candidates", "0"], "--candidates 0: profile at least one layout"),
    (["--lr", "-1"], "--lr -1.0: must be positive"),
    (["--mem-headroom", "1"], "--mem-headroom 1: give the fraction of a GPU's memory kept free"),  # what every layout fails on is said as it is
])
def test_bad_search_input_is_refused_before_any_rank_starts(machine, tmp_path, flags, message):
    r = run_main("train", *RUN, "--layout-search", "--machine", machine, *flags, "--out", tmp_path)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    if flags[0] == "--memory-per-rank" and flags[1] == "1MiB":
        assert "more; raise --memory-per-rank" in r.stderr  # how far the closest is


def test_the_search_is_trains_alone_and_refuses_a_users_model(machine, tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("[layout]\nsearch = true\n")
    r = run_main("verify", "--config", toml, *RUN)
    assert r.returncode == 2 and "--layout-search ([layout] search) is train's" in r.stderr, r.stderr
    r = run_main("train", "--model", "tests.models:make", "--layout-search", "--machine", machine, "--out", tmp_path)
    assert r.returncode == 2 and "is your own: give its layout flags" in r.stderr, r.stderr


def _transformer_search(mesh, machine, out):
    """examples/transformer.py's own model searched with the Python API, then trained and
    verified in the layout found (what a user's script does after the search)."""
    import meshtrain
    from examples import transformer as t

    batches = [t.batch(k, 8) for k in range(7)]
    shape = meshtrain.Shape(t.LAYERS, t.D, t.HEADS, t.VOCAB, t.SEQ, kind="llama", kv_heads=t.KV_HEADS, ffn=t.HIDDEN)
    common = dict(optimizer=t.adamw, loss_fn=meshtrain.cross_entropy, tp_plan=t.TP_PLAN, pipeline=t.PIPELINE,
                  clip_grad_norm=1.0)
    found = meshtrain.search_layout(t.make_model, batches, shape=shape, machine=machine, out=out, verbose=False,
                                    reprofile=True, **common)
    trained = _layout_losses(mesh, found.mesh, found.options, batches)
    report = meshtrain.verify(t.make_model, batches[:3], mesh=meshtrain.init(**found.mesh), **common, **found.options)
    return found.record, found.mesh, found.options, trained, report.passed


def _layout_losses(_, axes, options, batches=None):
    import meshtrain
    from examples import transformer as t

    batches = batches or [t.batch(k, 8) for k in range(7)]
    job = meshtrain.parallelize(t.make_model(), meshtrain.init(**axes), optimizer=t.adamw,
                                loss_fn=meshtrain.cross_entropy, tp_plan=t.TP_PLAN, pipeline=t.PIPELINE,
                                clip_grad_norm=1.0, **options)
    return [job.step(*batches[k]).loss for k in range(3)]


def test_the_api_searches_a_users_own_model(machine, tmp_path):
    """The search for a model of one's own (examples/transformer.py, given its shape): the
    candidates only what the model supports, the layout found trains as the same layout
    given by hand and passes verify."""
    record, axes, options, trained, passed = run_ranks(_transformer_search, 2, machine, str(tmp_path))[0]
    assert record["chosen"] is not None and len(record["candidates"]) == 3
    assert all(c["layout"]["cp"] == 1 and c["layout"]["ep"] == 1 for c in record["candidates"])
    assert json.loads((tmp_path / "layout-search.json").read_text()) == record
    assert axes == {k: record["candidates"][record["chosen"]]["layout"][k] for k in ("dp", "tp", "pp", "cp", "ep")}
    assert passed
    assert run_ranks(_layout_losses, 2, axes, options)[0] == trained


def test_a_search_setting_without_the_search_is_refused(tmp_path):
    r = run_main("train", *RUN, "--world", "3", "--candidates", "2", "--out", tmp_path)
    assert r.returncode == 2 and "--candidates, --world are --layout-search settings; add --layout-search" in r.stderr


def test_a_restarted_run_trains_the_layout_its_search_chose(machine, tmp_path):
    """A rank killed at step 2: the restarted ranks resume from step 1's checkpoint in the
    layout the first attempt's search chose, without searching again (--reprofile included:
    it asks the run's search for a fresh profile, not each restart)."""
    r = run_cli("train", *RUN[:-1], "3", "--layout-search", "--reprofile", "--machine", machine, "--save-every", "1",
                "--max-restarts", "1", "--out", tmp_path, "--json", env={"MESHTRAIN_FAULT": "kill:1:2"})
    assert r.returncode == 0, r.stderr[-3000:]
    got = last_json(r.stdout)
    assert r.stderr.count("profiling 1/3") == 1 and got["layout_search"]["resumed"]
    chosen = got["layout_search"]["candidates"][got["layout_search"]["chosen"]]["layout"]
    assert got["layout"] == {k: chosen[k] for k in got["layout"]} and got["first_step"] == 2


def test_the_axes_given_stay_fixed_and_the_rest_is_searched(machine, tmp_path):
    """--tp 2 on 4 ranks: every candidate keeps tp 2, among fewer layouts than without it."""
    from meshtrain.cli import build_parser
    from meshtrain.cli.config import from_args
    from meshtrain.cli.layout_search import plan_search
    from meshtrain.search_plan import SEARCHED

    def planned(*flags):
        args = build_parser(plan_flags=False).parse_args(["train", *RUN, "--layout-search", "--machine", machine,
                                                          "--world", "4", "--candidates", "6", *flags,
                                                          "--out", str(tmp_path)])
        return plan_search(from_args(args), None, None, "cpu")
    fixed, free = planned("--tp", "2"), planned()
    assert len(fixed.candidates) == 6 and all(c.layout.tp == 2 and c.layout.world_size == 4 for c in fixed.candidates)
    assert len({tuple(getattr(c.layout, k) for k in SEARCHED) for c in fixed.candidates}) == 6
    assert 0 < fixed.tried < free.tried and any(c.layout.tp != 2 for c in free.candidates)


def test_under_a_launcher_rank_0_plans_and_the_others_take_its_plan(machine, tmp_path):
    """torchrun's ranks: rank 0 alone runs the planner (a large world takes it seconds to
    minutes: one rank pays, not every one), the others join the group and take its plan;
    a refusal is rank 0's one line and exit 2."""
    import os
    from pathlib import Path

    from distributed import run_script_ranks

    from meshtrain.cli import build_parser
    from meshtrain.cli.config import from_args
    from meshtrain.cli.run import _prepare_data

    # The tokenized corpus cached first, as a launcher's job script would: ranks forked from the
    # tests' preloaded server cannot start the BPE trainer's own process.
    _prepare_data(from_args(build_parser(plan_flags=False).parse_args(["train", *RUN])))
    main = str(Path(__file__).resolve().parents[1] / "meshtrain" / "__main__.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ran = run_script_ranks(main, ["train", *RUN, "--layout-search", "--machine", machine, "--reprofile",
                                  "--out", str(tmp_path), "--json"], 2, env, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stderr.count("profiling 1/3") == 1 and "chosen" in ran.stderr
    assert last_json(ran.stdout)["layout_search"]["world"] == 2
    refused = run_script_ranks(main, ["train", *RUN, "--layout-search", "--machine", machine, "--memory-per-rank",
                                      "1MiB", "--out", str(tmp_path)], 2, env, timeout=300)
    assert refused.returncode == 2 and "fits no layout of 2 ranks" in refused.stderr, refused.stderr[-2000:]


def test_plan_search_shows_what_the_search_measured_beside_its_predictions(searched, machine):
    """`plan --search` of the same model, batch and world with the same profile: the layouts
    the search profiled carry its measurements, in the table and in --json."""
    _, r = searched
    measured = {json.dumps(c["layout"], sort_keys=True): c for c in last_json(r.stdout)["layout_search"]["candidates"]}
    ran = run_main("plan", *RUN, "--dropout", "0.1", "--gpus", "2", "--search", "--top", "1000", "--machine", machine,
                   "--gpu-mem-gib", "10", "--json")
    assert ran.returncode == 0, ran.stderr
    top = last_json(ran.stdout)["search"]["top"]
    shown = {json.dumps(row["layout"], sort_keys=True): row for row in top if "measured_step_s" in row}
    assert shown.keys() == measured.keys()
    assert all(shown[k]["measured_step_s"] == measured[k]["measured_step_s"] for k in shown)
    assert "meas s" in ran.stderr

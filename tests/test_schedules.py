"""Pipeline schedules as data and their simulator: the textbook figures exactly, every
schedule runnable for any (p, m, v), bad schedules caught, and `meshtrain schedule`."""

import random
from fractions import Fraction
from pathlib import Path

import pytest
from helpers import last_json, run_cli

from meshtrain.parallel.pipeline import schedules as S
from meshtrain.parallel.pipeline.simulate import ScheduleError, simulate

P, M = 4, 8


def run(name, p=P, m=M, v=1):
    return simulate(S.schedule(name, p, m, v), v, microbatches=m)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_take_the_textbook_time(name):
    """(m + p − 1)(t_f + t_b), and a bubble of (p − 1)/(m + p − 1) of the stage-time."""
    sim = run(name)
    assert sim.makespan == (M + P - 1) * (1 + 2)
    assert sim.bubble_fraction == Fraction(P - 1, M + P - 1)


def test_1f1b_holds_at_most_p_minus_i_microbatches_gpipe_all_of_them():
    assert run("1f1b").peak_inflight == [min(P - i, M) for i in range(P)]
    assert run("gpipe").peak_inflight == [M] * P
    assert run("1f1b", m=2).peak_inflight == [2, 2, 2, 1]


@pytest.mark.parametrize("v", [2, 4])
def test_interleaving_divides_the_bubble_by_the_number_of_chunks(v):
    """Relative to the ideal time m(t_f + t_b), 1F1B's bubble is (p − 1)/m; v chunks per stage
    make it (p − 1)/(m·v)."""
    ideal = M * 3
    bubble = run("interleaved", v=v).makespan - ideal
    assert bubble / ideal == Fraction(P - 1, M * v)
    assert bubble == (run("1f1b").makespan - ideal) / v


def test_zero_bubble_h1_leaves_a_third_of_the_1f1b_bubble_at_the_same_peak():
    """Forward, input gradient and weight gradient of 1 each: (p − 1)(F + B − W) against
    1F1B's (p − 1)(F + B + W), with at most p micro-batches held on any stage."""
    ideal = M * 3
    assert run("zb").makespan - ideal == (P - 1) * (1 + 1 - 1)
    assert run("1f1b").makespan - ideal == (P - 1) * 3
    assert max(run("zb").peak_inflight) == max(run("1f1b").peak_inflight) == P


def test_every_schedule_runs_for_any_shape():
    """Random (p, m, v): no deadlock, every send received, each (micro-batch, chunk) forward
    and backward exactly once, each backward after its forward (the simulator checks all)."""
    rng = random.Random(0)
    for _ in range(150):
        p, v = rng.randint(1, 6), rng.randint(1, 3)
        for name in S.SCHEDULES:
            m = p * rng.randint(1, 3) if name == "interleaved" else rng.randint(1, 12)
            sim = run(name, p, m, v if name == "interleaved" else 1)
            assert len([s for s in sim.spans if s.kind == "F"]) == p * m * (v if name == "interleaved" else 1)


def _swap(lists, stage, i, j):
    lists = [list(ops) for ops in lists]
    lists[stage][i], lists[stage][j] = lists[stage][j], lists[stage][i]
    return lists


def test_the_simulator_refuses_a_schedule_that_cannot_run():
    lists = S.schedule("1f1b", 2, 2)
    # a backward before its forward on the same stage
    back = next(i for i, op in enumerate(lists[1]) if isinstance(op, S.Backward))
    fwd = next(i for i, op in enumerate(lists[1]) if isinstance(op, S.Forward) and op.mb == lists[1][back].mb)
    with pytest.raises(ScheduleError):
        simulate(_swap(lists, 1, back, fwd), microbatches=2)
    # a micro-batch whose gradient is never received
    first_recv_grad = next(i for i, op in enumerate(S.flat(lists[0])) if isinstance(op, S.RecvGrad))
    with pytest.raises(ScheduleError, match="sent but never received|forward then backward"):
        simulate([S.flat(lists[0])[:first_recv_grad], lists[1]], microbatches=2)


# ---- NCCL's rules ---------------------------------------------------------------------------

def ungrouped(name, p, m, v=1):
    """The lists as this project issued them before it grouped transfers (the fixture the
    rules must refuse): each transfer alone, a receive right before the compute that needs
    it and a send right after the one that makes it."""
    lists = []
    for s in range(p):
        out = []
        for op in S.compute_order(name, s, p, m, v):
            receives, sends = S.transfers_of(s, op, p, v)
            out += receives + [op] + sends
        lists.append(out + [S.SyncGrads(), S.OptimizerStep()])
    return lists


def test_a_lone_send_waits_for_its_receive_so_two_stages_that_send_first_jam():
    """Stage 0 sends an activation while stage 1 sends a gradient, each alone: neither
    receive is posted, so both wait for ever (gloo would buffer both and go on)."""
    lists = [[S.Forward(0), S.Transfers((S.SendActivation(1),)), S.Transfers((S.RecvGrad(0),)), S.Backward(0)],
             [S.Forward(1), S.Backward(1), S.Transfers((S.SendGrad(0),)), S.Transfers((S.RecvActivation(1),))]]
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(lists)
    together = [[lists[0][0], S.Transfers((S.SendActivation(1), S.RecvGrad(0))), lists[0][3]],
                [lists[1][0], lists[1][1], S.Transfers((S.SendGrad(0), S.RecvActivation(1)))]]
    simulate(together)  # one group each: both progress


def test_messages_between_two_stages_match_by_order_whatever_their_kind():
    """Tags are ignored: the k-th message stage 0 sends to stage 1 is the k-th stage 1
    receives from it, so a receive order other than the send order is refused."""
    lists = [[S.Forward(0), S.Forward(1), S.Transfers((S.SendActivation(0), S.SendActivation(1)))],
             [S.Transfers((S.RecvActivation(1), S.RecvActivation(0))), S.Forward(0, 0), S.Forward(1, 0)]]
    with pytest.raises(ScheduleError, match="matches by order"):
        simulate(lists, chunks=1)


@pytest.mark.parametrize("name, shapes", [
    ("1f1b", [(p, m, 1) for p in (2, 3, 4) for m in (2, 4, 7)]),
    ("zb", [(p, m, 1) for p in (2, 3, 4) for m in (2, 4, 7)]),
    ("interleaved", [(p, k * p, v) for p in (2, 3, 4) for k in (1, 2) for v in (1, 2, 3)]),
])
def test_the_lists_issued_one_transfer_at_a_time_jam_under_nccls_rules(name, shapes):
    for p, m, v in shapes:
        with pytest.raises(ScheduleError, match="deadlock"):
            simulate(ungrouped(name, p, m, v), v, microbatches=m)
        simulate(S.schedule(name, p, m, v), v, microbatches=m)


def test_interleaved_needs_its_forward_and_backward_as_one_step():
    """Grouping per instruction is enough for 1F1B and zero-bubble but not for interleaved,
    which still jams at p = 2 from m = 4 (and at 3, 4): its steady state pairs a forward and
    a backward with no transfer between them, as Megatron's does."""
    for p, m in [(2, 4), (2, 6), (3, 6), (4, 8)]:
        per_instruction = [S.with_communication(s, S.compute_order("interleaved", s, p, m, 2), p, 2) for s in range(p)]
        with pytest.raises(ScheduleError, match="deadlock"):
            simulate(per_instruction, 2, microbatches=m)


def test_every_schedule_passes_nccls_rules_for_random_shapes():
    """The property: random (schedule, p, m, v) run to the end under NCCL's rules, with the
    same compute as the textbook figures; no case of today's one-at-a-time lists except
    GPipe's (which only ever sends one way at a time) does."""
    rng = random.Random(1)
    for _ in range(200):
        name = rng.choice(S.SCHEDULES)
        p = rng.randint(2, 6)
        v = rng.randint(1, 3) if name == "interleaved" else 1
        m = p * rng.randint(1, 3) if name == "interleaved" else rng.randint(2, 12)
        simulate(S.schedule(name, p, m, v), v, microbatches=m)
        if name != "gpipe":
            with pytest.raises(ScheduleError):
                simulate(ungrouped(name, p, m, v), v, microbatches=m)


def test_groups_of_sends_do_not_hold_up_compute():
    """A stage computes on while its sends wait for their receives (NCCL's stream is not the
    compute stream): zero-bubble keeps its (p − 1)(F + B − W) bubble under the rules."""
    ideal = M * 3
    assert run("zb").makespan - ideal == (P - 1) * (1 + 1 - 1)


def test_schedules_and_simulator_are_pure():
    """They run with no processes and import no torch at all."""
    for module in ("schedules.py", "simulate.py", "draw.py"):
        source = Path(S.__file__).with_name(module).read_text()
        assert "import torch" not in source and "from torch" not in source, module


def test_schedule_command_prints_the_timeline_and_the_contract_json(tmp_path):
    png = tmp_path / "zb.png"
    r = run_cli("schedule", "--pp", "4", "--microbatches", "8", "--schedule", "zb", "--png", png, "--json")
    assert r.returncode == 0, r.stderr
    j = last_json(r.stdout)
    assert j["bubble_fraction"] == pytest.approx(3 / 27) and j["peak_inflight"] == [4, 4, 4, 4]
    assert {"schedule", "pp", "microbatches", "chunks", "makespan", "timeline"} <= j.keys()
    assert "stage 3: .  .  .  F0 B0 F1" in r.stderr  # the text timeline, one cell per time unit
    assert png.stat().st_size > 5000


@pytest.mark.parametrize("args, message", [
    (["--schedule", "interleaved", "--chunks", "2", "--microbatches", "6"], "multiple of 4"),
    (["--schedule", "1f1b", "--chunks", "2", "--microbatches", "8"], "use --chunks 1"),
    (["--schedule", "zigzag", "--microbatches", "8"], "unknown schedule"),
    (["--microbatches", "0"], "--microbatches 0"),
])
def test_schedule_command_rejects_bad_input_in_one_line(args, message):
    r = run_cli("schedule", "--pp", "4", *args, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and message in r.stderr, r.stderr


def test_fewer_microbatches_than_stages_warns_and_runs():
    r = run_cli("schedule", "--pp", "4", "--microbatches", "2", timeout=60)
    assert r.returncode == 0 and "warning: 2 micro-batches for 4 stages" in r.stderr

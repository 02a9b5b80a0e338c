"""The strict point-to-point mode: gloo made to refuse what NCCL would hang on. Every
schedule verifies under it (`test_pipeline.py` runs its every-schedule layouts strictly),
and a stage that issues its transfers one at a time — the jam the simulator proves — is
stopped within the bound, with one line naming the stage and the transfer."""

import os
import re
import time
from unittest import mock

import pytest
from distributed import run_ranks

from meshtrain import verifier as verify
from meshtrain.comm import Comm
from meshtrain.cli.config import ConfigError, strict_p2p_requested
from test_pipeline import pp_config


def test_the_switch_takes_0_or_1_and_refuses_anything_else():
    assert strict_p2p_requested({}) is False
    assert strict_p2p_requested({"MESHTRAIN_STRICT_P2P": "0"}) is False
    assert strict_p2p_requested({"MESHTRAIN_STRICT_P2P": "1"}) is True
    with pytest.raises(ConfigError, match="use 1"):
        strict_p2p_requested({"MESHTRAIN_STRICT_P2P": "yes"})


def test_a_bad_switch_is_refused_in_one_line_before_any_rank_starts():
    from helpers import run_cli
    r = run_cli("verify", "--model", "gpt-tiny", "--pp", "2", env={"MESHTRAIN_STRICT_P2P": "2"}, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "MESHTRAIN_STRICT_P2P='2'" in r.stderr, r.stderr


def _one_transfer_at_a_time(mesh, cfg):
    """The mutant: each transfer of a group issued as a group of its own."""
    from meshtrain.parallel.pipeline import schedules as S
    from meshtrain.parallel.pipeline.engine import PipelineRunner
    real = PipelineRunner._Transfers

    def alone(self, group):
        for op in group.ops:
            real(self, S.Transfers((op,)))
    os.environ["MESHTRAIN_STRICT_P2P"] = "1"
    with mock.patch.object(PipelineRunner, "_Transfers", alone):
        start = time.perf_counter()
        try:
            verify.record(cfg, Comm(mesh), "layout")
        except Exception as e:  # noqa: BLE001 — the line and the time are the result
            return str(e), time.perf_counter() - start
    return None, time.perf_counter() - start


def test_transfers_issued_one_at_a_time_are_stopped_with_the_stage_and_the_transfer_named():
    """Both stages wait on a send; the first whose bound runs out names itself (the other
    then sees its peer gone, or runs out too)."""
    results = run_ranks(_one_transfer_at_a_time, 2, pp_config(2, "1f1b", 4, steps=2), pp=2, timeout=120)
    assert all(message is not None for message, _ in results), "a stage ran to the end"
    named = [(stage, message) for stage, (message, _) in enumerate(results) if "strict p2p" in message]
    assert named, results
    for stage, message in named:
        assert message.count("\n") == 0 and re.fullmatch(
            rf"strict p2p: stage {stage} waited 10 s at (SendActivation|SendGrad)\(mb=\d, chunk=0\) for stage "
            rf"{1 - stage} to post its receive: on NCCL this would hang", message), message
    assert 9 < min(seconds for _, seconds in results) and max(seconds for _, seconds in results) < 25, results

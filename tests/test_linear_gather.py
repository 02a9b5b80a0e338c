"""The all-gather path of data parallelism for linear layers (`--dp-linear-sync`) on real
gloo processes: verify on the MLP and the GPT, the dp traffic of `comm.py`'s formulas for
each choice, `auto`'s rule, a layer of the user's own, and the refusals."""

from contextlib import nullcontext

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from distributed import run_ranks
from helpers import small_config, verdict

from meshtrain import verifier as verify
from meshtrain.comm import Comm, cheaper_linear_sync, linear_sync_bytes, linear_sync_crossover
from meshtrain.cli.config import Config, ConfigError, LayoutConfig, TrainConfig, load
from meshtrain.cli.validate import validate, warnings
from meshtrain.train import parallelize_config as parallelize
from meshtrain.parallel.linear_gather import LinearGather, linear_layers, mark_linear
from meshtrain.train import train


def gather_config(sync, dp, microbatches=1, model="mlp", hidden="", batch=16, steps=3) -> Config:
    c = small_config(model, steps, batch, dp=dp, microbatches=microbatches, dp_linear_sync=sync)
    c.model.mlp_hidden = hidden
    return c


# ---- the rule, from the formulas alone --------------------------------------------------

@pytest.mark.parametrize("n_in, n_out, crossover", [(1024, 1024, 1025), (64, 1024, 123), (1024, 10, 20)])
def test_auto_gathers_exactly_below_the_crossover_of_the_formulas(n_in, n_out, crossover):
    """B·(n_in + n_out) < 2·(n_in + 1)·n_out: 1024×1024 gathers up to B = 1024, 64→1024 up
    to B = 122 (the issue's ~120), the 1024→10 head up to B = 19."""
    for n in (2, 4, 8):
        for rows in range(1, 2 * crossover):
            sent = linear_sync_bytes(n_in, n_out, True, rows, n)
            expected = "allgather" if sent["allgather"] < sent["allreduce"] else "allreduce"
            assert cheaper_linear_sync(n_in, n_out, True, rows, n) == expected
            assert (expected == "allgather") == (rows < crossover)
    assert crossover - 1 < linear_sync_crossover(n_in, n_out) <= crossover  # gathers for every B below it


def test_the_formulas_are_the_ring_counts():
    sent = linear_sync_bytes(64, 32, True, rows=10, n=4, grad_size=4, activation_size=2)
    assert sent == {"allreduce": 2 * 3 / 4 * 65 * 32 * 4, "allgather": 3 / 4 * 10 * 96 * 2}


# ---- verify ------------------------------------------------------------------------------

def _records(mesh, cfgs):
    return [verify.record(cfg, Comm(mesh), "layout") for cfg in cfgs]


@pytest.mark.parametrize("world, cfgs", [
    (2, [gather_config("allgather", 2), gather_config("allgather", 2, microbatches=2),
         gather_config("allgather", 2, model="gpt-tiny", batch=4, microbatches=2)]),
    (4, [gather_config("allgather", 4), gather_config("allgather", 4, microbatches=2, batch=32)]),
], ids=["dp2-mlp-mb2-and-gpt-tiny", "dp4-mlp-mb2"])
def test_allgather_passes_verify(world, cfgs):
    for cfg, rec in zip(cfgs, run_ranks(_records, world, cfgs)[0]):
        result = verdict(cfg, rec)
        assert result["passed"], (cfg.model.name, cfg.layout.short(), result["failures"])
        assert not rec["problems"]


# ---- traffic -----------------------------------------------------------------------------

def _traffic(mesh, cfgs):
    out = []
    for cfg in cfgs:
        r = train(cfg, Comm(mesh))
        out.append({"dp": r.comm_per_step["dp"], "detail": r.comm_detail_per_step["dp"], "notes": r.parallel.notes})
    return out


MLP_SHAPES = [(64, 256), (256, 256), (256, 10)]  # --mlp-hidden 256,256 on digits: (n_in, n_out), all with bias


@pytest.mark.parametrize("dp, batch", [(2, 48), (4, 400)])
def test_dp_traffic_per_step_is_the_formula_for_each_choice(dp, batch):
    """allreduce, allgather and auto on an MLP whose layers cross over at different batches:
    at B = 48 auto gathers two layers of three, at B = 400 none. Every byte on dp is one of
    the layers' formula terms (one micro-batch and two: the same bytes)."""
    syncs = ["allreduce", "allgather", "auto"]
    cfgs = [gather_config(s, dp, hidden="256,256", batch=batch, steps=2) for s in syncs]
    cfgs.append(gather_config("auto", dp, microbatches=2, hidden="256,256", batch=batch, steps=2))
    results = run_ranks(_traffic, dp, cfgs)[0]
    formulas = [linear_sync_bytes(n_in, n_out, True, batch, dp) for n_in, n_out in MLP_SHAPES]
    chosen = [cheaper_linear_sync(n_in, n_out, True, batch, dp) for n_in, n_out in MLP_SHAPES]
    expected = {"allreduce": ["allreduce"] * 3, "allgather": ["allgather"] * 3, "auto": chosen}
    for sync, r in zip(syncs + ["auto"], results):
        choice = expected[sync]
        assert r["dp"] == round(sum(f[c] for f, c in zip(formulas, choice))), (sync, r)
        kinds = {"all_reduce" if c == "allreduce" else "all_gather" for c in choice}
        assert set(r["detail"]) == kinds
        # the choice said at start is the one made
        assert [note.split(": ")[2].split(" ")[0] for note in r["notes"]] == (choice if sync != "allreduce" else [])
    assert chosen == (["allgather", "allgather", "allreduce"] if batch == 48 else ["allreduce"] * 3)


# ---- a layer of the user's own -------------------------------------------------------------

class Scaled(nn.Module):
    """A user's linear layer (not an nn.Linear): marked, it takes the all-gather path."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) / n_in ** 0.5)
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


def _user_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(mark_linear(Scaled(6, 12)), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3))


def _user_layer_grads(mesh):
    model = _user_model(0)
    layout = LayoutConfig(dp=mesh.size("dp"), dp_linear_sync="allgather")
    p = parallelize(model, Comm(mesh), layout, TrainConfig(batch_size=8))
    gathered = next(s for s in p.grad_sync.syncs if isinstance(s, LinearGather))
    torch.manual_seed(1)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    rows = slice(mesh.coord("dp") * 4, mesh.coord("dp") * 4 + 4)
    for half in (slice(0, 2), slice(2, 4)):  # two micro-batches, the first under no_sync
        with p.grad_sync.no_sync() if half.start == 0 else nullcontext():
            (F.cross_entropy(p.module(x[rows][half]), y[rows][half], reduction="sum") / 8).backward()
    p.grad_sync.finish_grad_sync()
    return {n: q.grad.clone() for n, q in p.module.named_parameters()}, len(gathered.layers)


def test_a_marked_user_layer_gets_the_full_batch_gradient():
    whole = _user_model(0)
    torch.manual_seed(1)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    (F.cross_entropy(whole(x), y, reduction="sum") / 8).backward()
    assert [name for name, _ in linear_layers(whole)] == ["0", "2", "4"]
    for grads, n_layers in run_ranks(_user_layer_grads, 2):
        assert n_layers == 3
        for name, q in whole.named_parameters():
            torch.testing.assert_close(grads[name], q.grad, rtol=1e-5, atol=1e-7)


def test_a_shared_weight_keeps_the_all_reduce():
    """A tied weight has gradient from elsewhere too, which only the all-reduce sums."""
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    assert [name for name, _ in linear_layers(nn.Sequential(a, b, nn.Linear(4, 2)))] == ["2"]


# ---- bad input ---------------------------------------------------------------------------

def _checked(**layout) -> Config:
    cfg = gather_config("allreduce", 2)
    cfg.model.name, cfg.train.data, cfg.train.seq_len = "gpt-test", "shakespeare", 32
    for k, v in layout.items():
        setattr(cfg.layout, k, v)
    validate(cfg)
    return cfg


def test_bad_linear_sync_input_is_refused_or_warned():
    with pytest.raises(ConfigError, match="--dp-linear-sync allreduce \\| allgather \\| auto"):
        _checked(dp_linear_sync="gather")
    for layout in ({"zero": 1}, {"tp": 2}, {"pp": 2, "dp": 1}):
        with pytest.raises(ConfigError, match="--dp-linear-sync allgather is built for plain data parallelism"):
            _checked(dp_linear_sync="allgather", **layout)
    assert any("all-reduces" in w for w in warnings(_checked(dp_linear_sync="auto", zero=1)))
    assert any("with dp=1" in w for w in warnings(_checked(dp_linear_sync="allgather", dp=1)))
    assert not warnings(_checked(dp_linear_sync="allgather"), "verify")


def test_mlp_hidden_widths_from_a_flag_or_toml(tmp_path):
    cfg = gather_config("allreduce", 2, hidden="1024,1024")
    validate(cfg)
    assert cfg.model.spec().hidden == (1024, 1024)
    toml = tmp_path / "wide.toml"
    toml.write_text('[model]\nname = "mlp"\nmlp_hidden = [512, 256]\n[layout]\ndp_linear_sync = "auto"\n')
    from_file = load(str(toml), {})
    assert from_file.model.spec().hidden == (512, 256) and from_file.layout.dp_linear_sync == "auto"
    for bad in ("1024,,8", "0", "wide"):
        with pytest.raises(ConfigError, match="--mlp-hidden"):
            validate(gather_config("allreduce", 2, hidden=bad))
    gpt = _checked()
    gpt.model.mlp_hidden = "8"
    with pytest.raises(ConfigError, match="--mlp-hidden sets the widths of --model mlp"):
        validate(gpt)

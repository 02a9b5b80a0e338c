"""A verifier is only as good as the bugs it catches. Each mutant below is a deliberately
broken variant of the real code, introduced by the test itself inside the spawned ranks
(patched there, never switched on in the library). `verify` must FAIL on every one, naming
the first bad step and tensor, and PASS on the real code.

Later strategies add their own mutants to MUTANTS."""

import re
from contextlib import contextmanager
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from distributed import run_ranks
from helpers import verdict
from mutant_harness import records_of_every_mutant, verdicts_of
from presets import GPT_TEST_4

from meshtrain import verifier as verify
from meshtrain.comm import Comm
from meshtrain.cli.config import Config

STEPS = 3  # every step sampled (1, 2, 3): the middle one is 2
MIDDLE = verify.lockstep_steps(STEPS)[1]  # a step in the middle that verify samples


def mutant_config(**layout) -> Config:
    c = Config()
    c.model.name = GPT_TEST_4
    c.layout.dp, c.layout.microbatches, c.layout.bucket_mb = 2, 2, 0.02  # several buckets
    for k, v in layout.items():
        setattr(c.layout, k, v)
    c.train.steps, c.train.batch_size, c.train.seq_len, c.train.vocab_size = STEPS, 8, 32, 256
    c.train.warmup, c.train.device = 1, "cpu"
    return c


# The layouts the mutants run in: data parallelism (also with each block compiled); tensor parallelism with and without SP;
# pipelines (1F1B, GPipe, zero-bubble) and a pipeline with data parallelism; ZeRO stages 1
# and 3; data parallelism with every linear layer on the all-gather path; a pipeline that
# recomputes its blocks, with dropout; context parallelism (the ring), with dropout.
LAYOUTS = {"dp": mutant_config(), "tp": mutant_config(dp=1, tp=2, microbatches=1),
           "tp-sp": mutant_config(dp=1, tp=2, sp=True, microbatches=1),
           "pp": mutant_config(dp=1, pp=2, microbatches=4), "pp-gpipe": mutant_config(dp=1, pp=2, microbatches=4,
                                                                                       schedule="gpipe"),
           "dp-pp": mutant_config(pp=2, microbatches=2), "zero1": mutant_config(zero=1),
           "zero3": mutant_config(zero=3), "dp-allgather": mutant_config(dp_linear_sync="allgather"),
           "pp-recompute": mutant_config(dp=1, pp=2, microbatches=4, recompute="full"),
           "pp-zb": mutant_config(dp=1, pp=2, microbatches=4, schedule="zb"),
           "cp": mutant_config(dp=1, cp=2, microbatches=1), "cp-dropout": mutant_config(dp=1, cp=2, microbatches=1),
           "dp-compile": mutant_config(compile=True, compile_backend="aot_eager")}
LAYOUTS["pp-recompute"].model.dropout = 0.1
LAYOUTS["cp-dropout"].model.dropout = 0.1


# ---- the mutants: each returns the patches that break one thing ---------------------------

def local_loss_normalizer():
    """The loss divided by the local instead of the global token count."""
    import meshtrain.train as T
    real = T.loss_terms_per_step
    return [mock.patch.object(T, "loss_terms_per_step", lambda cfg: real(cfg) // cfg.layout.dp)]


def averaged_on_top_of_the_sum():
    """Gradients averaged over ranks although the loss is already divided globally."""
    from meshtrain.parallel.data import DataParallel
    real = DataParallel.finish_grad_sync

    def finish(self):
        real(self)
        for bucket in self.buckets:
            bucket.buffer.div_(self.comm.mesh.size(self.axis))
    return [mock.patch.object(DataParallel, "finish_grad_sync", finish)]


def bucket_skipped_on_a_middle_step():
    """One bucket's all-reduce skipped on a middle step."""
    from meshtrain.comm import _Done
    from meshtrain.parallel.data import DataParallel
    real_launch, real_finish = DataParallel._launch, DataParallel.finish_grad_sync
    syncs = {"done": 0}

    def launch(self, bucket):
        if syncs["done"] + 1 == MIDDLE and bucket.index == 1:
            return _Done()
        return real_launch(self, bucket)

    def finish(self):
        real_finish(self)
        syncs["done"] += 1
    return [mock.patch.object(DataParallel, "_launch", launch),
            mock.patch.object(DataParallel, "finish_grad_sync", finish)]


def data_slice_shifted():
    """Data-parallel rank 1 reads its slice of the global batch one sample early."""
    from meshtrain.mesh import Mesh
    real = Mesh.rows

    def rows(self, batch_size):
        r = real(self, batch_size)
        return slice(r.start - 1, r.stop - 1) if self.coord("dp") == 1 else r
    return [mock.patch.object(Mesh, "rows", rows)]


def one_gradient_unsynchronised():
    """One parameter left out of the gradient buckets: its gradient stays local."""
    import meshtrain.parallel.data as D
    real = D.split_by_size
    return [mock.patch.object(D, "split_by_size", lambda params, cap: real(params[:5] + params[6:], cap))]


def microbatches_not_accumulated():
    """Only the last micro-batch's gradients kept: the earlier ones are dropped."""
    from meshtrain.parallel.data import DataParallel
    real = DataParallel.no_sync

    @contextmanager
    def no_sync(self):
        with real(self):
            yield
        for bucket in self.buckets:
            bucket.buffer.zero_()
    return [mock.patch.object(DataParallel, "no_sync", no_sync)]


def column_input_gradient_not_reduced():
    """Tensor parallelism: the backward all-reduce where activations enter a region (the
    gradient of the column-parallel layers' input) is missing."""
    from meshtrain.parallel.tensor import _CopyToRegion
    return [mock.patch.object(_CopyToRegion, "backward", staticmethod(lambda ctx, grad: (grad, None)))]


def layernorm_gradients_not_reduced_under_sp():
    """Sequence parallelism: LayerNorm gradients, computed on sequence shards, not summed over tp."""
    import meshtrain.parallel.compose as P
    real = P.apply_plan

    def apply_plan(model, plan, comm, sp):
        whole = real(model, plan, comm, sp)
        norms = {id(p) for n, p in model.named_parameters() if ".ln" in n or n.startswith("norm.")}
        return [p for p in whole if id(p) not in norms]
    return [mock.patch.object(P, "apply_plan", apply_plan)]


def cross_entropy_without_the_max_all_reduce():
    """Vocabulary-parallel cross-entropy: each rank shifts by its own maximum."""
    import torch.distributed as dist

    from meshtrain.comm import Comm
    real = Comm.all_reduce

    def all_reduce(self, tensor, axis, *, op=dist.ReduceOp.SUM, **kw):
        return None if op == dist.ReduceOp.MAX else real(self, tensor, axis, op=op, **kw)
    return [mock.patch.object(Comm, "all_reduce", all_reduce)]


def microbatches_share_one_receive_buffer():
    """Pipeline: every message of a kind is received into one buffer, which a later
    micro-batch overwrites while an earlier one's backward still needs it."""
    from meshtrain.parallel.pipeline.engine import PipelineRunner

    def buffer(self, op):
        shared = self.__dict__.setdefault("mutant_buffers", {})
        return shared.setdefault(type(op), torch.empty(self.activation_shape, dtype=self.dtype))
    return [mock.patch.object(PipelineRunner, "_buffer", buffer)]


def a_stage_skips_its_data_parallel_sync():
    """Pipeline with data parallelism: the second stage never all-reduces its gradients."""
    from meshtrain.comm import _Done
    from meshtrain.parallel.data import DataParallel
    real = DataParallel._launch
    return [mock.patch.object(DataParallel, "_launch",
                              lambda self, bucket: _Done() if self.comm.mesh.coord("pp") == 1 else real(self, bucket))]


def first_microbatch_gradients_dropped():
    """Pipeline: every stage throws away the weight gradients of micro-batch 0."""
    from meshtrain.parallel.pipeline.engine import PipelineRunner
    real = PipelineRunner._Backward

    def backward(self, op):
        real(self, op)
        if op.mb == 0:
            for q in self.stage.model.parameters():
                q.grad.zero_()
    return [mock.patch.object(PipelineRunner, "_Backward", backward)]


def a_rank_updates_another_ranks_partition():
    """ZeRO: every rank takes the next rank's partition for its own and steps it with the
    gradients the reduce-scatter gave it (those of its own partition)."""
    from meshtrain.parallel.zero import FlatGroup
    real = FlatGroup.__init__

    def init(self, index, label, named, comm, axis, keep_full, draw=None, **options):
        mesh = comm.mesh

        class Shifted:  # the mesh, every dp coordinate one further along
            def __getattr__(_, name):
                return getattr(mesh, name)

            def coord(_, a):
                return (mesh.coord(a) + 1) % mesh.size(a) if a == axis else mesh.coord(a)

        real(self, index, label, named, SimpleNamespace(mesh=Shifted()), axis, keep_full, draw, **options)
    return [mock.patch.object(FlatGroup, "__init__", init)]


def reduce_scatter_without_the_sum():
    """ZeRO: gradients scattered without the sum: each rank keeps its own part of its own
    gradients, not the sum of every rank's."""
    from meshtrain.comm import Comm, _Done

    def scatter(self, output, tensor, axis, *, async_op=False, **_):
        output.copy_(tensor.view(self.mesh.size(axis), -1)[self.mesh.coord(axis)])
        return _Done() if async_op else None
    return [mock.patch.object(Comm, "reduce_scatter", scatter)]


def errors_not_gathered():
    """All-gather DP for linear layers: the inputs are gathered but not the errors: each
    rank pairs every rank's inputs with its own output-gradients, repeated."""
    from meshtrain.parallel.linear_gather import LinearGather
    real = LinearGather.inputs_and_errors

    def mine_only(self, layer, gathered):
        xs, ds = real(self, layer, gathered)
        n, coord = self.comm.mesh.size(self.axis), self.comm.mesh.coord(self.axis)
        rows = ds.shape[0] // n
        return xs, ds[coord * rows:(coord + 1) * rows].repeat(n, 1)
    return [mock.patch.object(LinearGather, "inputs_and_errors", mine_only)]


def recomputed_with_the_current_dropout_keys():
    """Recomputation draws the dropout masks of whichever micro-batch the pipeline ran last,
    not those of the micro-batch it recomputes."""
    from contextlib import nullcontext

    import meshtrain.parallel.recompute as R
    return [mock.patch.object(R, "_keys_at", lambda keys, where, again=False: nullcontext())]


def mlp_chunks_drop_with_the_first_chunks_rows():
    """Under full recomputation the MLP runs in chunks of rows; each chunk draws the dropout
    masks of the first chunk's rows, not of its own."""
    import meshtrain.parallel.recompute as R
    rows_from = R._rows_from
    return [mock.patch.object(R, "_rows_from", lambda run, keys, first: rows_from(run, keys, 0))]


def weight_pass_tells_no_synchroniser():
    """Zero-bubble: the weight pass forms the linear layers' ∇W but, as no hook fires for a
    gradient formed by hand, never hands it to the synchroniser."""
    from meshtrain.parallel.pipeline.engine import PipelineRunner
    real = PipelineRunner._BackwardWeight

    def weight_pass(self, op):
        if self.stage.is_first(op.chunk):
            return real(self, op)
        for _ in self.store.weight_grads((op.mb, op.chunk)):
            pass
        self._p.grad_sync.end_weight_pass()
    return [mock.patch.object(PipelineRunner, "_BackwardWeight", weight_pass)]


def store_keeps_one_micro_batch_per_layer():
    """Zero-bubble: a linear layer's kept (input, output gradient) replaces the pair of any
    earlier micro-batch still waiting for its weight pass (one slot per layer)."""
    from meshtrain.parallel.pipeline.split import WeightGradStore
    real = WeightGradStore.keep

    def keep(self, weight, x, grad):
        for pairs in self._kept.values():
            pairs[:] = [pair for pair in pairs if pair[0] is not weight]
        real(self, weight, x, grad)
    return [mock.patch.object(WeightGradStore, "keep", keep)]


def blocks_merged_without_the_lse_correction():
    """Ring attention: each block's output added as if normalised on its own, not rescaled by
    the log-sum-exp rule."""
    from meshtrain.parallel import context

    def merge(out, lse, part, part_lse):
        out.add_(part)
        lse.copy_(torch.logaddexp(lse, part_lse))
    return [mock.patch.object(context, "_merge", merge)]


def keys_not_placed_head_tail():
    """Queries placed head-tail, but the visiting keys taken as a contiguous split's (chunks
    2·owner and 2·owner + 1): the causal mask and the skipped blocks go wrong."""
    from meshtrain.parallel import context

    def pairs(rank, owner, cp):
        for i, qi in enumerate(context.chunk_ids(rank, cp)):
            for j, kj in enumerate((2 * owner, 2 * owner + 1)):
                if kj <= qi:
                    yield i, j, kj == qi
    return [mock.patch.object(context, "_pairs", pairs)]


def gradients_not_reduced_over_cp():
    """The parameters' gradient buckets not reduced over the cp replicas (here, with dp 1:
    reduced nowhere)."""
    from meshtrain.comm import _Done
    from meshtrain.parallel.data import DataParallel
    return [mock.patch.object(DataParallel, "_launch", lambda self, bucket: _Done())]


def dropout_masks_drawn_per_cp_rank():
    """Each cp rank draws its dropout masks as if its tokens were a sequence of their own (the
    keyed masks of positions 0..s/cp−1), not the one-process masks of its tokens."""
    from meshtrain.parallel.dropout import SeededDropout
    return [mock.patch.object(SeededDropout, "tokens", property(lambda self: None, lambda self, value: None),
                              create=True)]


def evaluation_skips_the_cp_split():
    """Evaluation under context parallelism: every cp rank runs the whole sequence, not its
    head-tail share, and the cp ranks' losses are summed as shares."""
    from meshtrain.job import Job
    real = Job.evaluate

    def evaluate(self, *args, **kwargs):
        self._sequence_shard = lambda batch: batch  # shadows the method for this call
        try:
            return real(self, *args, **kwargs)
        finally:
            del self._sequence_shard
    return [mock.patch.object(Job, "evaluate", evaluate)]


def a_tensor_counted_twice_in_the_norm():
    """Clipping's norm counts one gradient twice (a parameter listed twice in what is normed,
    as a tied one collected from both its modules would be): blocks.1.attn.v.bias, the
    smallest share of ‖g‖² above 1e-4 at step 1 (1.3e-4 on gpt-test-4; the norm then reads
    7e-5 high). Nothing else changes but clipping's scale, which Adam all but hides."""
    import meshtrain.job as J
    real_update, real_norm = J.Job.update, J.grad_norm

    def update(self, loss):
        twice = dict(self.parallel.named_parameters())["blocks.1.attn.v.bias"]
        with mock.patch.object(J, "grad_norm", lambda params, comm, **kw: real_norm([*params, twice], comm, **kw)):
            return real_update(self, loss)
    return [mock.patch.object(J.Job, "update", update)]


# name -> (the mutant, the layout it runs in)
def compiled_block_miscomputes():
    """--compile: the compiled graphs compute their first output 0.1 % off (a stand-in for a
    miscompiled kernel). Verify's reference is never compiled, so it must see the difference."""
    from meshtrain.parallel import compose

    def perturbed(gm, example_inputs):
        def run(*args):
            outs = gm(*args)
            return type(outs)([outs[0] * 1.001, *outs[1:]])
        return run

    def compile_blocks(blocks, options):
        for block in blocks:
            block.forward = torch.compile(block.forward, backend=perturbed, dynamic=False)
    return [mock.patch.object(compose, "compile_blocks", compile_blocks)]


MUTANTS = {f.__name__: (f, layout) for f, layout in (
    (local_loss_normalizer, "dp"), (averaged_on_top_of_the_sum, "dp"), (bucket_skipped_on_a_middle_step, "dp"),
    (data_slice_shifted, "dp"), (one_gradient_unsynchronised, "dp"), (microbatches_not_accumulated, "dp"),
    (column_input_gradient_not_reduced, "tp"), (layernorm_gradients_not_reduced_under_sp, "tp-sp"),
    (cross_entropy_without_the_max_all_reduce, "tp"), (microbatches_share_one_receive_buffer, "pp-gpipe"),
    (a_stage_skips_its_data_parallel_sync, "dp-pp"), (first_microbatch_gradients_dropped, "pp"),
    (a_rank_updates_another_ranks_partition, "zero1"), (reduce_scatter_without_the_sum, "zero3"),
    (errors_not_gathered, "dp-allgather"), (recomputed_with_the_current_dropout_keys, "pp-recompute"),
    (mlp_chunks_drop_with_the_first_chunks_rows, "pp-recompute"), (weight_pass_tells_no_synchroniser, "pp-zb"),
    (store_keeps_one_micro_batch_per_layer, "pp-zb"), (blocks_merged_without_the_lse_correction, "cp"),
    (keys_not_placed_head_tail, "cp"), (gradients_not_reduced_over_cp, "cp"),
    (dropout_masks_drawn_per_cp_rank, "cp-dropout"), (evaluation_skips_the_cp_split, "cp"),
    (compiled_block_miscomputes, "dp-compile"), (a_tensor_counted_twice_in_the_norm, "tp"))}
# Mutants that first fail the held-out check (`job.evaluate` after the step): one that trains
# correctly. (The miscompiled block fails step 1's gradients: verify runs no activation meter,
# so its blocks run compiled from the first step — docs/compile.md.)
EVALUATION = {"evaluation_skips_the_cp_split"}
# Mutants that first fail the gradient-norm check (what clipping scales by): every gradient right.
NORM = {"a_tensor_counted_twice_in_the_norm"}
# The step at which each mutant first does harm.
FIRST_BAD_STEP = {name: MIDDLE if name == "bucket_skipped_on_a_middle_step" else 1 for name in MUTANTS}


@pytest.fixture(scope="module")
def verdicts():
    def ranks(world, layouts, **axes):
        return run_ranks(records_of_every_mutant, world, layouts, LAYOUTS, MUTANTS, **axes)[0]
    records = ranks(2, ["dp", "zero1", "zero3", "dp-allgather", "dp-compile"])
    records.update(ranks(2, ["tp", "tp-sp"], tp=2))
    records.update(ranks(2, ["pp", "pp-gpipe", "pp-recompute", "pp-zb"], pp=2))
    records.update(ranks(4, ["dp-pp"], pp=2))
    records.update(ranks(2, ["cp", "cp-dropout"], cp=2))
    return verdicts_of(records, LAYOUTS)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_real_code_passes(verdicts, layout):
    real = verdicts[f"real {layout}"]
    assert real["passed"], real["failures"]
    assert real["max_grad_rel_diff"] <= verify.GRAD_TOLERANCE / 10  # a margin, not a scrape


@pytest.mark.parametrize("name", MUTANTS)
def test_verify_fails_on_the_mutant_naming_step_and_tensor(verdicts, name):
    v = verdicts[name]
    assert not v["passed"], f"{name} slipped through verify"
    first = v["first_failure"]
    assert first.startswith(f"step {FIRST_BAD_STEP[name]}:"), first
    if name in EVALUATION:
        assert "held-out loss" in first, first
        return
    if name in NORM:
        assert "gradient norm" in first, first
        return
    # a tensor is named: a parameter's gradient or update, or a rank's copy of one
    assert re.search(r"(gradient|update|weights)", first) and re.search(r"\.(weight|bias)\b", first), first


def test_a_miscompiled_block_is_caught_in_training_too(verdicts):
    """The compiled blocks train from verify's first step (it runs no activation meter, which
    makes `train`'s first step eager): the gradients differ, and verify names them."""
    failures = verdicts["compiled_block_miscomputes"]["failures"]
    assert any(re.match(r"step 1: .*\.(weight|bias) gradient", f) for f in failures), failures


def test_unsynchronised_gradient_is_caught_on_the_rank_that_holds_it(verdicts):
    """Replicas that should be bit-identical are checked on every rank, not only rank 0."""
    assert any("rank 1's" in f for f in verdicts["one_gradient_unsynchronised"]["failures"])


def _stage_3_without_the_backward_gather(mesh):
    from meshtrain.parallel.zero import Zero
    with mock.patch.object(Zero, "_gather_for_backward", lambda self, group: None):
        try:
            verify.record(LAYOUTS["zero3"], Comm(mesh), "mutant")
        except RuntimeError as e:
            return str(e)
    return None


def test_a_block_freed_before_its_backward_gathers_it_stops_with_a_clear_error():
    """ZeRO-3 with the gather before each block's backward left out: autograd's saved
    parameters are markers of freed memory, and unpacking one raises rather than computing
    on garbage."""
    for message in run_ranks(_stage_3_without_the_backward_gather, 2):
        assert message is not None and "were freed before its backward gathered them" in message, message


def _long_run(mesh, cfg):
    return verify.record(cfg, Comm(mesh), "layout")


def test_long_run_does_not_cry_wolf():
    """100 steps, warm-up of 1: each sampled step is checked from the layout's own state, so
    rounding has nothing to accumulate over and a correct layout still passes."""
    cfg = mutant_config(microbatches=1)
    cfg.train.steps = 100
    rec = run_ranks(_long_run, 2, cfg)[0]
    result = verdict(cfg, rec)
    assert result["passed"], result["failures"]
    assert result["lockstep_steps"] == [1, 50, 100]
    assert torch.isfinite(torch.tensor(result["max_param_rel_diff"]))

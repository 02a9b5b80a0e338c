"""meshtrain: every strategy of distributed training, small, readable, and verified
against one-process training.

The Python API (for your own model, optimizer and loop):

    import meshtrain, torch
    mesh = meshtrain.init(dp=None, tp=1, pp=1)          # joins torchrun/srun/mpirun ranks
    job = meshtrain.parallelize(model, mesh, zero=3,
                                optimizer=lambda named: torch.optim.AdamW((p for _, p in named), lr=1e-3),
                                loss_fn=meshtrain.cross_entropy, clip_grad_norm=1.0)
    for inputs, targets in batches:                       # the global batch, alike on every rank
        out = job.step(inputs, targets)                   # out.loss, out.grad_norm, out.lr
    report = meshtrain.verify(make_model, batches, optimizer=..., dp=2, zero=3)

init            the device mesh (`Mesh`: sizes, coordinates, `rows(batch_size)`)
parallelize     apply the strategies to a model; returns a `Job` (step, forward, save, load)
verify          a layout against one process on your batches (`VerifyReport`)
full_shape      the full shape of a parameter, shard or ZeRO piece (for optimizer factories)
adamw           the command line's optimizer factory (what `job.load` of its checkpoints needs)
low_bit_adamw   torchao's AdamW with 8-bit, 4-bit or fp8 moments ("adamw8bit", "adamw4bit", "adamwfp8")
cross_entropy   the mean cross-entropy over non-ignored targets, classes last
TensorPlan, COLUMN, ROW, VOCAB, REGION, SEQUENCE, Fused, Heads    tensor-parallel plans
PipelinePlan    how a model is cut into pipeline stages
Recipe          a model of yours for `meshtrain train|verify --model pkg.module:factory`
Fp8Options      parallelize(fp8=...): the recipe, emulation, the smallest layer converted
FaultTolerance  init(ft=...): these ranks are one of R replica groups on torchft; the loop
                asks `job.begin_step()` for each step (a joining group heals there)
search_layout   the fastest layout of this world for your model, planned then profiled
                (`SearchedLayout`: `mesh` for init, `options` for parallelize); `Shape` its shape

Importing meshtrain loads none of these (nor torch) until one is used: the command line
refuses a bad flag in a fraction of a second."""

__version__ = "0.1.0"

_API = {
    "init": "meshtrain.session",
    "Mesh": "meshtrain.mesh",
    "parallelize": "meshtrain.job", "Job": "meshtrain.job", "StepOutput": "meshtrain.step_output",
    "cross_entropy": "meshtrain.loss_terms",
    "verify": "meshtrain.lockstep", "VerifyReport": "meshtrain.lockstep",
    "full_shape": "meshtrain.optim", "adamw": "meshtrain.optim", "low_bit_adamw": "meshtrain.lowbit",
    "TensorPlan": "meshtrain.parallel.styles", "COLUMN": "meshtrain.parallel.styles",
    "ROW": "meshtrain.parallel.styles", "VOCAB": "meshtrain.parallel.styles", "REGION": "meshtrain.parallel.styles",
    "SEQUENCE": "meshtrain.parallel.styles", "Fused": "meshtrain.parallel.styles", "Heads": "meshtrain.parallel.styles",
    "PipelinePlan": "meshtrain.parallel.pipeline.plan",
    "Recipe": "meshtrain.recipe",
    "FaultTolerance": "meshtrain.replicas",
    "Fp8Options": "meshtrain.parallel.options",
    "search_layout": "meshtrain.searched", "SearchedLayout": "meshtrain.searched", "Shape": "meshtrain.plan.shapes",
}
__all__ = sorted(_API)


def __getattr__(name: str):
    if name in _API:
        import importlib
        value = getattr(importlib.import_module(_API[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'meshtrain' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_API))

"""`compile=True`: each block's forward compiled by `torch.compile`, in torchtitan's order.

The unit is the block (a child of the block list, or of a pipeline stage's chunk): the
code that repeats, whose graph is the same for every block, so one compilation serves all
(dynamo keys its cache on the code and guards, not the module). Only the block's `forward`
method is replaced, on the instance, so names, parameters, hooks and state dict stay as they
are: no `_orig_mod.` prefix anywhere, and ZeRO-3's gather and free hooks, which wrap the
module's call, run eagerly around the compiled forward (torchtitan compiles before
FSDP2's `fully_shard` for the same reason).

It is applied after the tensor-parallel plan, context parallelism and zero-bubble's split
(the forward it compiles is what those made of the block) and before activation
checkpointing (whose recomputation then calls the compiled forward again) and ZeRO.
Collectives run eagerly between compiled graphs: every collective of `comm.Comm` is
`torch.compiler.disable`d, so dynamo breaks the graph at a tensor-parallel layer's
communication instead of tracing a process group. `fullgraph` is not asked for: it would
hold only where a block has no collective inside (dp, ZeRO, pp without tp or cp), and
`compile_stats` counts the breaks where it does not."""

from __future__ import annotations

import importlib
from contextlib import nullcontext

import torch
import torch.nn as nn

from meshtrain.parallel.options import CompileOptions


def compile_problem(backend: str) -> str | None:
    """Why this torch cannot compile with `backend` (a name `CompileOptions` accepted), in one
    line, or None."""
    if not hasattr(torch, "compile") or not hasattr(torch, "_dynamo"):
        return f"--compile: torch {torch.__version__} has no torch.compile; use torch >= 2.11 or leave --compile off"
    if not torch._dynamo.is_dynamo_supported():
        return "--compile: torch.compile is not supported on this Python or platform; leave --compile off"
    if backend == "inductor":
        try:
            importlib.import_module("torch._inductor")  # kernels need a C++ compiler on CPU, triton on CUDA
        except Exception as e:  # noqa: BLE001 - any import failure means no inductor
            return f"--compile: torch's inductor backend cannot be loaded ({e}); try --compile-backend aot_eager"
    return None


def check_compilable(model: nn.Module, options: CompileOptions | None) -> None:
    """Refuse in one line a model compiled before `parallelize` (its names would all carry
    `_orig_mod.`, which no plan, checkpoint or Hugging Face map names), and `compile=True` on
    a torch that cannot."""
    first = compiled_first(model)
    if first is not None:
        raise ValueError(f"model: {first} was compiled by torch.compile before parallelize, which renames every "
                         f"parameter '_orig_mod.*'; pass the plain model and compile=True (meshtrain compiles each "
                         f"block after the strategies have cut it; the command line's --compile)")
    if options is not None and (problem := compile_problem(options.backend)) is not None:
        raise ValueError(problem)


def compile_blocks(blocks: list[nn.Module], options: CompileOptions) -> None:
    """Replace each block's `forward` by its compiled self, in place."""
    for block in blocks:
        block.forward = torch.compile(block.forward, backend=options.backend, dynamic=False)


def compiled_first(model: nn.Module) -> str | None:
    """A model (or a module of it) compiled before `parallelize` is an `OptimizedModule`
    whose parameters are named `_orig_mod.*`: the name of the first such module, or None."""
    optimized = getattr(torch._dynamo.eval_frame, "OptimizedModule", ())
    return next((name or "the model" for name, m in model.named_modules() if isinstance(m, optimized)), None)


def eager_while(flag: bool):
    """Compiled blocks run eagerly inside (when `flag`): a dispatch mode over the step (the
    activation meter) would otherwise make dynamo skip their code for good, and a forward
    without gradients (evaluation, the end of a run's sample) would compile every block
    again: dynamo guards on the grad mode, and those forwards run once in a while."""
    return torch.compiler.set_stance("force_eager") if flag else nullcontext()


def compile_stats() -> dict:
    """What dynamo did in this process so far: the graphs it compiled, and its graph breaks
    (in all, and by the first line of their reason)."""
    counters = torch._dynamo.utils.counters
    breaks = dict(counters["graph_break"])
    return {"graphs": int(counters["stats"].get("unique_graphs", 0)), "graph_breaks": sum(breaks.values()),
            "break_reasons": {reason.split("\n")[0][:120]: n for reason, n in breaks.items()}}

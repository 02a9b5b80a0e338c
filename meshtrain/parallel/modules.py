"""Where a strategy finds things in a model it does not know: the submodule to swap for its
parallel twin, and the list of blocks it acts on per block. Generic over `nn.Module`s, so no
strategy needs to name a model."""

from __future__ import annotations

import torch


def replace_submodule(model: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    """Put `new` where the submodule called `name` is (strategies swap in parallel twins)."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def find_block_list(model: torch.nn.Module, name: str | None = None) -> tuple[str, torch.nn.ModuleList]:
    """The model's list of blocks: the one called `name`, or else its largest `nn.ModuleList`
    or `nn.Sequential` (by parameters; the model itself may be one) — what strategies that
    act per block (ZeRO-3, recompute) act on."""
    if name is not None:
        return name, model.get_submodule(name)
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential))]
    if not lists:
        raise ValueError("this strategy acts per block, and the model has no nn.ModuleList or nn.Sequential of "
                         "blocks; name the modules (wrap=[...]) or the block list (a pipeline plan's `blocks`)")
    return max(lists, key=lambda nm: sum(p.numel() for p in nm[1].parameters()))

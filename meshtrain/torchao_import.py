"""torchao, imported with its import-time messages quieted: a CPU build cannot load its CUDA
kernels and says so for each, and one of its registrations trips a deprecation inside torch.
ImportError naming meshtrain's extra when torchao is missing."""

from __future__ import annotations

import importlib
import logging


def import_torchao(*modules: str) -> list:
    """The torchao modules named (e.g. "torchao.float8"), imported quietly."""
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        return [importlib.import_module(m) for m in modules]
    except ImportError as e:
        raise ImportError(f"{modules[0]} is torchao's, which is not installed: pip install 'meshtrain[fp8]'") from e
    finally:
        for q, level in zip(quiet, levels):
            q.setLevel(level)

"""Tensor-parallel plans as data: module-name patterns to styles (no torch, so that a model
family's recipe states its plan beside its presets, read before torch loads). What each
style does is `parallel/tensor.py`'s docstring."""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatch

COLUMN, ROW, VOCAB, REGION, SEQUENCE = "column", "row", "vocab", "region", "sequence"
SEQUENCE_SHARDED, HEAD_SHARDED = "sequence-sharded", "head-sharded"
PARTIAL = "partial"  # its parameters' gradients are partial over tp even without SP (a per-head norm)


@dataclass(frozen=True)
class Fused:
    """The style of a fused linear: its output is the concatenation of `sections` (widths),
    each split over tp in multiples of `unit`."""
    sections: tuple[int, ...]
    unit: int = 1


class Heads:
    """The style that divides a module's head-count attributes by tp."""

    def __init__(self, *attrs: str):
        self.attrs = attrs

    def __repr__(self) -> str:
        return f"Heads{self.attrs!r}"


@dataclass(frozen=True)
class TensorPlan:
    """Module-name patterns (fnmatch, '*' for a block index) to a style or a tuple of styles;
    `vocab_parallel_loss`: the output is sharded over the vocabulary, so the loss is the
    vocabulary-parallel cross-entropy."""
    styles: dict[str, object] = field(default_factory=dict)
    vocab_parallel_loss: bool = False

    def styles_of(self, name: str) -> tuple:
        found = []
        for pattern, styles in self.styles.items():
            if fnmatch(name, pattern):
                found += list(styles) if isinstance(styles, tuple) else [styles]
        return tuple(found)

"""Which tokens of the micro-batch being computed count in a mixture of experts' balancing
loss: the step's mask [rows, sequence] (False: padding, which transformers' attention mask
leaves out of its balancing loss too), cut the way the layout cuts the tokens.

A MoE layer asks for its tokens' part while it runs (`MoE.token_mask`). Which rows those are
is what the dropout keys already track for every layout (`DropoutKeys.rows`: set before each
micro-batch's forward on every pipeline stage, put back for a recomputation, narrowed to an
MLP's row chunks); context parallelism then holds its two chunks of each row
(`shard_sequence`), and sequence parallelism its contiguous 1/tp of the sequence."""

from __future__ import annotations

import torch

from meshtrain.mesh import Mesh
from meshtrain.parallel.context import shard_sequence
from meshtrain.parallel.dropout import DropoutKeys


class TokenMask:
    def __init__(self, keys: DropoutKeys, mesh: Mesh, sp: bool):
        self.keys, self.mesh, self.sp = keys, mesh, sp
        self.mask: torch.Tensor | None = None  # the step's rows, from global row `offset` on
        self.offset = 0

    def set_step(self, mask: torch.Tensor | None, offset: int = 0) -> None:
        """The step's mask (bool, on the device): the global batch's rows, or with `offset`
        this rank's rows from that global row on."""
        self.mask, self.offset = mask, offset

    @torch.compiler.disable  # which rows is Python state of the step
    def current(self) -> torch.Tensor | None:
        """[tokens] bool: this rank's tokens of the micro-batch being computed, flattened as
        the layer flattens them."""
        if self.mask is None:
            return None
        rows = self.keys.rows
        part = self.mask[rows.start - self.offset:rows.stop - self.offset]
        if self.mesh.size("cp") > 1:
            part = shard_sequence(part, self.mesh.coord("cp"), self.mesh.size("cp"))
        if self.sp and self.mesh.size("tp") > 1:
            part = part.chunk(self.mesh.size("tp"), dim=1)[self.mesh.coord("tp")]
        return part.reshape(-1)

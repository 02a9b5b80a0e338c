"""Low-bit AdamW on torchao (`--optimizer adamw8bit|adamw4bit|adamwfp8`): the two moments
kept in 8 bits, 4 bits or fp8, in blocks of 256 (128 for 4 bits) elements, each block with
its fp32 scale — about 2.03, 1.06 and 2.03 bytes a parameter instead of AdamW's 8.

A block's scale is its largest magnitude, so an optimizer that steps a piece of a tensor
steps it as it would the whole only where the piece's blocks are the whole tensor's. So:

- the choice to quantize a tensor is torchao's rule (bitsandbytes': at least 4,096 elements,
  a whole number of blocks) applied to the one-process tensor (`full_shape`), not to the
  piece, so every layout quantizes the same tensors;
- ZeRO lays its flat groups out with every parameter, and every shard, starting on a block
  (`state_block`, read by `parallel/zero.py`), so its pieces are runs of whole blocks;
- a tensor-parallel or expert-parallel shard must itself be a run of whole blocks of the
  tensor (`check_state_blocks`; refused with one line otherwise).

The step is torchao's `single_param_adam`, compiled on a GPU (as torchao does) and, unless
`compile=True`, eager elsewhere: on this CPU inductor takes ~10 s a tensor shape to compile
it (a few steps, a test, would wait minutes), then steps 18× faster (1M elements: 37 ms
against 663 ms eager) — worth it over a long CPU run.

Checkpoints and the full state see each quantized moment as two per-element fp32 tensors
(`readable_state`): its value (`exp_avg`) and its block's scale (`exp_avg.adamw8bit_scale`,
`scale_key`), so they are cut and resharded like any moment; the optimizer rebuilds the
exact codes from them at its next step (`restore`). A tensor left in fp32 has a scale of 0;
another kind's checkpoint (or AdamW's) is quantized afresh from its values."""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from meshtrain.optim import OptimizerFactory, decay_groups, full_shape
from meshtrain.parallel.options import LOW_BIT_OPTIMIZERS
from meshtrain.torchao_import import import_torchao

LOW_BIT = LOW_BIT_OPTIMIZERS  # --optimizer name -> (torchao's class, block size)
MIN_QUANTIZED = 4096  # torchao's (and bitsandbytes') smallest quantized tensor
MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def scale_key(key: str, kind: str) -> str:
    """The plain state's key of moment `key`'s block scales under `kind` ("exp_avg.adamw8bit_scale"):
    named by kind, since each kind's scales mean another thing (8 and 4 bits: the block's
    largest magnitude; fp8: that over fp8's largest), so another kind's are not taken for its own."""
    return f"{key}.{kind}_scale"


def quantizes(shape, block: int) -> bool:
    """Whether a tensor of this (one-process) shape keeps its moments in low bits."""
    n = math.prod(shape)
    return n >= MIN_QUANTIZED and n % block == 0


@lru_cache(maxsize=None)
def _optim():
    """torchao's optimizer modules (imported once, quietly; ImportError naming the extra)."""
    return import_torchao("torchao.optim", "torchao.optim.adam", "torchao.optim.quant_utils")


def is_low_bit(v) -> bool:
    """A torchao quantized optimizer state."""
    return torch.is_tensor(v) and type(v) is not torch.Tensor and hasattr(v, "codes") and hasattr(v, "scale")


def readable_state(optimizer: torch.optim.Optimizer, t: torch.Tensor) -> dict:
    """`optimizer`'s state of `t` as plain tensors, what checkpoints and the full state read:
    under a low-bit optimizer each moment as its value and its block scales per element (0
    where it is kept in fp32), so that every tensor has the same keys; else as it is."""
    entry = optimizer.state.get(t, {})
    kind = getattr(optimizer, "kind", None)
    if kind is None:
        return entry
    out = {}
    for key, v in entry.items():
        if key in MOMENTS and is_low_bit(v):
            out[key] = v.dequantize()
            out[scale_key(key, kind)] = v.scale.repeat_interleave(v.block_size).view(v.shape)
        elif key in MOMENTS and scale_key(key, kind) not in entry:  # kept in fp32
            out[key], out[scale_key(key, kind)] = v, torch.zeros_like(v)
        else:  # the step, or a moment loaded and not yet restored, with its scales
            out[key] = v
    return out


def held_bytes(v: torch.Tensor) -> int:
    """The bytes a state tensor holds: a quantized one's codes, scales and code map."""
    if is_low_bit(v):
        names, _ = v.__tensor_flatten__()
        return sum(getattr(v, n).numel() * getattr(v, n).element_size() for n in names)
    return v.numel() * v.element_size()


@lru_cache(maxsize=None)
def low_bit_class(kind: str) -> type:
    """torchao's low-bit AdamW of `kind`, deciding what to quantize on one-process shapes,
    stepping eagerly off the GPU, and restoring its codes from `readable_state`'s tensors."""
    optim, adam, quant_utils = _optim()
    base = getattr(optim, LOW_BIT[kind][0])
    kind_name = kind

    class LowBitAdamW(base):
        state_block = LOW_BIT[kind_name][1]
        kind = kind_name
        compile_step: bool | None = None  # the step compiled (None: on CUDA only)

        def _new_buffer(self, p, signed: bool):
            if not quantizes(full_shape(p), self.block_size):
                return torch.zeros_like(p)
            if p.numel() % self.block_size:  # a piece that is not whole blocks: a layout check missed it
                raise ValueError(f"{kind}: a piece of {p.numel()} elements of a {tuple(full_shape(p))} tensor is not "
                                 f"a whole number of {self.block_size}-element blocks")
            return self._subclass_zeros(p, signed, self.block_size)

        def restore(self, p, state: dict) -> None:
            """Moments loaded as plain tensors (`readable_state`'s, or another optimizer's) in
            low bits again: the exact codes from a value and this kind's scales, else quantized
            afresh from the value."""
            for key in MOMENTS:
                scale, value = state.pop(scale_key(key, self.kind), None), state.get(key)
                for other in [k for k in state if k.startswith(key + ".") and k.endswith("_scale")]:
                    state.pop(other)  # another kind's scales: its values are quantized afresh below
                if value is None or is_low_bit(value):
                    continue
                buf = self._new_buffer(p, signed=key == "exp_avg")
                if not is_low_bit(buf):
                    state[key] = value.to(p.device, torch.float32)
                    continue
                if scale is None:  # not saved in low bits: quantized as torchao would
                    buf.copy_(value)
                else:
                    _set_codes(buf, value.to(buf.scale.device), scale.to(buf.scale.device), quant_utils)
                state[key] = buf

        @torch.no_grad()
        def step(self, closure=None):
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    if len(state) == 0:
                        state["step"] = torch.tensor(0.0)
                        state["exp_avg"] = self._new_buffer(p, True)
                        state["exp_avg_sq"] = self._new_buffer(p, False)
                        if group["amsgrad"]:
                            state["max_exp_avg_sq"] = self._new_buffer(p, False)
                    self.restore(p, state)
                    state["step"] += 1
                    if not torch.is_tensor(group["lr"]):
                        group["lr"] = torch.tensor(group["lr"], dtype=torch.float32)
                    single = adam.single_param_adam
                    if self.compile_step or (self.compile_step is None and p.device.type == "cuda"):
                        single = torch.compile(single, fullgraph=True, dynamic=False)
                    single(p.detach(), p.grad, state["step"], state["exp_avg"], state["exp_avg_sq"],
                           state.get("max_exp_avg_sq"), group["lr"], group["betas"][0], group["betas"][1],
                           group["weight_decay"], group["eps"], self.is_adamw,
                           self.bf16_stochastic_round and p.dtype is torch.bfloat16)
            return loss

    LowBitAdamW.__name__ = LowBitAdamW.__qualname__ = base.__name__
    return LowBitAdamW


def _set_codes(buf, value: torch.Tensor, scale: torch.Tensor, quant_utils) -> None:
    """`buf`'s codes for `value` on the given per-element block `scale` (`readable_state`'s)."""
    block = buf.block_size
    scales = scale.reshape(-1, block)[:, 0].contiguous()
    if hasattr(buf, "qmap"):  # 8 or 4 bits: codes into a map of [-1, 1]
        unit = value.reshape(-1, block) / scales.view(-1, 1).clamp(min=1e-12)
        if buf.codes.numel() * 2 == value.numel():  # 4 bits, two codes a byte
            codes = quant_utils.quantize_4bit_with_qmap(unit.reshape(-1), buf.qmap)
            buf.codes.copy_((codes[::2] << 4) | codes[1::2])
        else:
            buf.codes.copy_(quant_utils.quantize_8bit_with_qmap(unit, buf.qmap).view(buf.codes.shape))
    else:  # fp8 codes, the scale mapping the block's largest magnitude to fp8's
        unit = value.reshape(-1, block) / scales.view(-1, 1)
        buf.codes.copy_(unit.to(buf.codes.dtype).view(buf.codes.shape))
    buf.scale.copy_(scales)


def low_bit_adamw(kind: str, lr: float, weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.95),
                  eps: float = 1e-8, compile: bool | None = None) -> OptimizerFactory:
    """The factory of `--optimizer KIND` (adamw8bit, adamw4bit, adamwfp8): torchao's low-bit
    AdamW with `adamw`'s groups (matrices decay, vectors do not). Its `state_block` tells
    ZeRO the block its shards must start on. `compile`: the step compiled by torch.compile
    (None: on CUDA only; see the module's docstring)."""
    if kind not in LOW_BIT:
        raise ValueError(f"optimizer {kind!r}: use one of {', '.join(LOW_BIT)}")

    def make(named):
        optimizer = low_bit_class(kind)(decay_groups(named, weight_decay), lr=lr, betas=betas, eps=eps)
        optimizer.compile_step = compile
        return optimizer
    make.state_block = LOW_BIT[kind][1]
    return make

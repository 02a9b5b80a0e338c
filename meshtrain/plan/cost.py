"""The peak FLOP rates model FLOPs are measured against (MFU), and a block's forward FLOPs
by part for the planner. A whole step's model FLOPs are each model family's formula
(`Family.flops_per_step` in `meshtrain.recipes`).

A count what the model needs, not what an implementation recomputes (activation
checkpointing adds work but not model FLOPs), so MFU compares layouts fairly."""

from __future__ import annotations

# Dense peak FLOP/s per device by (device-name fragment, precision): the vendor's figures.
# fp32 is the plain (non-tensor-core) rate: meshtrain keeps TF32 off so fp32 matches the CPU.
# The first fragment found in the device's name wins: H100 PCIe and NVL before SXM ("H100").
PEAK_FLOPS = {
    ("H200", "bf16"): 989e12, ("H200", "fp32"): 67e12,
    ("H100 PCIe", "bf16"): 756e12, ("H100 PCIe", "fp32"): 51e12,
    ("H100 NVL", "bf16"): 835e12, ("H100 NVL", "fp32"): 60e12,
    ("H100", "bf16"): 989e12, ("H100", "fp32"): 67e12,
    ("A100", "bf16"): 312e12, ("A100", "fp32"): 19.5e12,
}


def peak_flops(device_name: str, precision: str) -> float | None:
    """The device's dense peak for `precision`, or None when unknown (CPUs, other GPUs)."""
    for (fragment, prec), flops in PEAK_FLOPS.items():
        if fragment in device_name and prec == precision:
            return flops
    return None


def layer_forward_flops(shape, micro_batch: int, seq: int, layer: int | None = None) -> dict[str, float]:
    """Block `layer`'s forward FLOPs for `micro_batch` sequences, by part: the linear layers
    (q, k, v, output projection; the MLP's two matrices, or SwiGLU's three; in a MoE layer
    the router, the k experts' SwiGLUs each token takes and a shared expert's: the active
    parameters) and the attention core (QKᵀ and the product with V, counted whole as
    Megatron does, not halved for the causal mask). For the GPT shape: 24·b·s·h² and
    4·b·s²·h. `layer` None: a repeated block's (a MoE layer for the moe kind)."""
    bs, h, f, kv, q = micro_batch * seq, shape.hidden, shape.ffn_width, shape.kv_width, shape.q_width
    if layer is None:
        layer = shape.first_moe_layer
    if shape.is_moe(layer):
        mlp = 2 * bs * h * (shape.experts + 3 * shape.top_k * shape.expert_ffn + 3 * shape.shared_ffn)
    else:
        mlp = 2 * bs * h * f * (2 if shape.kind == "gpt" else 3)
    linear = 2 * bs * h * (2 * q + 2 * kv) + mlp
    return {"linear": float(linear), "attention": 4.0 * micro_batch * seq * seq * q}


def head_forward_flops(shape, micro_batch: int, seq: int) -> float:
    """The logits: 2·b·s·h·V."""
    return 2.0 * micro_batch * seq * shape.hidden * shape.vocab


def model_flops(shape, batch: int, seq: int) -> float:
    """Model FLOPs of one step (forward and a backward of twice its cost) on `batch`
    sequences: 72·B·s·l·h²·(1 + s/6h + V/(12·l·h)) for the GPT shape (`recipes.gpt.flops_per_step`),
    generalised to SwiGLU's three matrices of width ffn, grouped-query attention, a head size
    other than h/heads, and a MoE's active parameters (each family's `flops_per_step`, the
    trainer's MFU numerator: a test holds them equal)."""
    blocks = sum(n * sum(layer_forward_flops(shape, batch, seq, i).values()) for i, n in _kinds(shape))
    return 3 * (blocks + head_forward_flops(shape, batch, seq))


def _kinds(shape) -> list[tuple[int, int]]:
    """(a block's index, how many blocks are of its kind), for each kind of block (a MoE's
    dense and MoE layers; one kind for the others)."""
    if shape.kind != "moe":
        return [(0, shape.layers)]
    return [(i, n) for i, n in ((shape.first_moe_layer, shape.moe_layers),
                                (shape.first_dense_layer, shape.layers - shape.moe_layers)) if n]


def recomputed_flops(shape, batch: int, seq: int, recompute: str) -> float:
    """The forward work activation checkpointing repeats in backward: every block's forward
    under `full` and `segments` (each segment runs again, its first boundary kept), the
    attention core under `selective`."""
    mode = recompute.split(":")[0]
    if mode == "none":
        return 0.0
    total = 0.0
    for i, n in _kinds(shape):
        layer = layer_forward_flops(shape, batch, seq, i)
        total += n * (layer["attention"] if mode == "selective" else layer["linear"] + layer["attention"])
    return total


def hardware_flops(shape, batch: int, seq: int, recompute: str = "none") -> float:
    """FLOPs the devices execute: model FLOPs plus the recomputation. With full recompute
    of a GPT, Narayanan et al. (2021) eq. 3: 96·B·s·l·h²·(1 + s/6h + V/(16·l·h))."""
    return model_flops(shape, batch, seq) + recomputed_flops(shape, batch, seq, recompute)

"""Model FLOPs per step and the peak FLOP rates they are measured against (MFU).

The GPT's count is Megatron's (Narayanan et al. 2021, appendix). Forward, per layer: the
four h×h attention projections and the two h×4h MLP matrices, 24·B·s·h² FLOPs; the attention
scores and their weighting, 4·B·s²·h; once, the logits, 2·B·s·h·V. Backward costs twice
forward, so a step is  72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)).
It counts what the model needs, not what an implementation recomputes (activation
checkpointing adds work but not model FLOPs), so MFU compares layouts fairly."""

from __future__ import annotations

from meshtrain.models.presets import GPTSpec, MLPSpec

# Dense peak FLOP/s per device by (device-name fragment, precision): the vendor's figures.
# fp32 is the plain (non-tensor-core) rate: meshtrain keeps TF32 off so fp32 matches the CPU.
PEAK_FLOPS = {
    ("H200", "bf16"): 989e12, ("H200", "fp32"): 67e12,
    ("H100", "bf16"): 989e12, ("H100", "fp32"): 67e12,
    ("A100", "bf16"): 312e12, ("A100", "fp32"): 19.5e12,
}


def gpt_flops_per_step(spec: GPTSpec, vocab_size: int, batch: int, seq_len: int) -> float:
    """Model FLOPs of one training step (forward and backward) of the GPT on `batch` sequences."""
    s, h, l = seq_len, spec.d_model, spec.n_layers
    return 72.0 * batch * s * l * h * h * (1 + s / (6 * h) + vocab_size / (12 * l * h))


def mlp_flops_per_step(spec: MLPSpec, n_inputs: int, n_classes: int, batch: int) -> float:
    """2 FLOPs per weight and sample forward, twice that backward."""
    widths = (n_inputs, *spec.hidden, n_classes)
    weights = sum(a * b for a, b in zip(widths, widths[1:]))
    return 6.0 * batch * weights


def peak_flops(device_name: str, precision: str) -> float | None:
    """The device's dense peak for `precision`, or None when unknown (CPUs, other GPUs)."""
    for (fragment, prec), flops in PEAK_FLOPS.items():
        if fragment in device_name and prec == precision:
            return flops
    return None

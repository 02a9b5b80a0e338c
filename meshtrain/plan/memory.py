"""Memory per device, analytically: model states by ZeRO stage, and activations per layer.

Model states (`model_state_bytes`), for Ψ parameters on one device's share and N
data-parallel ranks, in bytes per parameter (params + grads + master + optimizer):

    accounting  precision         stage 0     1                2               3
    paper       mixed (K = 12)    2+2+12      2+2+12/N         2+14/N          16/N     (ZeRO, Rajbhandari et al. 2020, §3-5)
    torch       fp32              4+4+8       4+4+8/N          4+12/N          16/N     (AdamW's two moments, no master)
    torch       bf16              2+2+4+8     2+2+12/N         2+14/N          16/N
    torch       bf16, fp32 grads  2+4+4+8     2+4+12/N         2+16/N          18/N

`torch` is what meshtrain keeps (tests match it to the trainer's measurement exactly, up
to ZeRO's padding of each flat group to a multiple of N); `paper` is the ZeRO paper's mixed
precision with K = 12 bytes of optimizer state per parameter.

Activations (`activation_bytes_per_layer`, the `paper` accounting: Korthikanti et al. 2022,
Table 2, 16-bit activations and 1-byte dropout masks), for micro-batch b, sequence s,
hidden h, a heads, tensor-parallel size t:

    no recompute                  s·b·h·(10 + 24/t + 5·a·s/(h·t))      (t = 1: 34 + 5as/h)
    with sequence parallelism     s·b·h·(34/t + 5·a·s/(h·t))
    selective recompute           s·b·h·(10 + 24/t)   (with SP: 34/t)  — the 5as/h term gone
    full recompute                2·s·b·h             (with SP: /t)    — the block's input only

The first pipeline stage holds the activations of `in_flight` micro-batches at once: p under
1F1B whatever p is, scaled by 1 + (p−1)/(p·v) when interleaved (Narayanan et al. 2021)."""

from __future__ import annotations

PAPER_K = 12  # the ZeRO paper's optimizer bytes per parameter under mixed precision (fp32 master, m, v)


def model_state_bytes(n_params: float, zero: int, dp: int, *, precision: str = "bf16", grad_dtype: str = "compute",
                      accounting: str = "torch", gathered_params: float = 0) -> dict[str, float]:
    """Bytes one device holds for `n_params` parameters (its share after tp and pp), by part,
    with a `total`. Under ZeRO-3 with dp > 1, `gathered_params` are held whole at their
    peak (`zero3_peak_gathered`), in the parameters' precision: a part of its own."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage {zero}: use 0, 1, 2 or 3")
    if accounting == "paper":
        param, grad, master, optim = 2, 2, 0, PAPER_K
    elif accounting == "torch":
        low = precision == "bf16"
        param = 2 if low else 4
        grad = 4 if (not low or grad_dtype == "fp32") else 2
        master, optim = (4 if low else 0), 8
    else:
        raise ValueError(f"unknown accounting '{accounting}'; use paper or torch")
    shard = {"params": zero >= 3, "grads": zero >= 2, "master": zero >= 1, "optimizer": zero >= 1}
    per_param = {"params": param, "grads": grad, "master": master, "optimizer": optim}
    out = {part: n_params * nbytes / (dp if shard[part] else 1) for part, nbytes in per_param.items()}
    if zero == 3 and dp > 1:
        out["gathered"] = gathered_params * param
    out["total"] = sum(out.values())
    return out


def activation_bytes_per_layer(seq: int, micro_batch: int, hidden: int, heads: int, *, tp: int = 1,
                               sp: bool = False, recompute: str = "none") -> float:
    """Korthikanti et al. (2022), Table 2: one transformer layer's activation bytes on one
    tensor-parallel rank (16-bit activations, 1-byte dropout masks)."""
    sbh = seq * micro_batch * hidden
    attention_core = 5 * heads * seq / (hidden * tp)
    rest = 34 / tp if sp else 10 + 24 / tp
    if recompute == "none":
        return sbh * (rest + attention_core)
    if recompute == "selective":
        return sbh * rest
    if recompute == "full":
        return 2 * sbh / (tp if sp else 1)
    raise ValueError(f"recompute '{recompute}': the paper's table has none, selective and full")


def in_flight(pp: int, microbatches: int, schedule: str = "1f1b", chunks: int = 1) -> float:
    """Micro-batches whose activations the first pipeline stage holds at once, in units of a
    whole stage's worth: min(p, m) under 1F1B, times 1 + (p−1)/(p·v) when interleaved; all m
    under GPipe."""
    if pp == 1:
        return 1
    if schedule == "gpipe":
        return microbatches
    held = min(pp, microbatches)
    return held * (1 + (pp - 1) / (pp * chunks)) if schedule == "interleaved" else held


def device_params(shape, *, tp: int = 1, pp: int = 1, stage: int = 0, chunks: int = 1,
                  stage_layers: list[int] | None = None) -> tuple[int, int, int]:
    """What one device holds (`torch` accounting: meshtrain's tensor-parallel plan and
    pipeline cut), as (blocks, parameters per block, parameters outside the blocks).

    Tensor parallelism splits every matrix of a block, the column layers' biases, the token
    embedding and the head by tp; LayerNorms (RMSNorms), the row layers' biases and the
    position embedding stay whole. Pipeline stage `stage` holds its virtual stages' blocks
    (split as `split_layers` does), the embedding on stage 0, the final norm and the
    (untied) head on the last."""
    from meshtrain.parallel.pipeline.stages import split_layers

    h, f, kv, v = shape.hidden, shape.ffn_width, shape.kv_width, shape.vocab
    if shape.kind == "llama":
        split_part, whole_part = 2 * h * h + 2 * h * kv + 3 * h * f, 2 * h
        embed, final = v * h // tp, h
    else:
        split_part = 4 * h * h + 2 * h * f + 2 * h + f  # q, k, v, proj, fc, proj; the q, v and fc biases
        whole_part = 2 * h + 4 * h  # the row layers' biases, two LayerNorms
        embed, final = v * h // tp + shape.seq_len * h, 2 * h
    ranges = split_layers(shape.layers, pp * chunks, stage_layers)
    blocks = sum(len(ranges[c * pp + stage]) for c in range(chunks))
    rest = (embed if stage == 0 else 0) + (final + v * h // tp if stage == pp - 1 else 0)
    return blocks, split_part // tp + whole_part, rest


def params_per_device(shape, **where) -> int:
    """The parameters one device holds (`device_params`' arguments)."""
    blocks, per_block, rest = device_params(shape, **where)
    return blocks * per_block + rest


def zero3_peak_gathered(shape, **where) -> int:
    """Parameters ZeRO-3 holds whole at its peak (`torch` accounting): everything outside
    the blocks, gathered on first use, and two blocks — the one computing and the next,
    prefetched."""
    blocks, per_block, rest = device_params(shape, **where)
    return rest + min(2, blocks) * per_block


def torch_activation_bytes_per_layer(seq: int, micro_batch: int, hidden: int, heads: int, *, element_bytes: int = 4,
                                     attention: str = "sdpa", dropout: float = 0.0, ffn: int | None = None,
                                     tp: int = 1, sp: bool = False) -> int:
    """What one block of meshtrain's GPT keeps for backward on one rank (`torch` accounting,
    no recompute), for `element_bytes`-byte activations (4 fp32, 2 bf16); t = tp, and the
    "whole" terms are divided by t too under sequence parallelism:

    - whole: the two LayerNorms' outputs and the residual stream after attention and after
      the MLP, 4·bsh elements; the LayerNorms' means and reciprocal deviations, 4·b·s;
    - split by heads or columns: q, k, v and the attention output, 4·bsh/t; the MLP's two
      activations of width f, 2·b·s·f/t;
    - `math`: softmax's output (b·(a/t)·s² elements) and the causal mask (s² bytes); with
      dropout also the dropped probabilities (b·(a/t)·s² elements) and their mask (bytes);
    - `sdpa`: the fused kernel's log-sum-exp (b·(a/t)·s, fp32);
    - dropout on the attention and MLP outputs: their masks (2·bsh bytes, whole).

    The trainer's layer probe measures exactly this (tests hold the two equal, with and
    without tp and SP)."""
    e, b, s, h, a, t = element_bytes, micro_batch, seq, hidden, heads, tp
    f = ffn or 4 * h
    whole = t if sp else 1  # what SP also shards along the sequence
    elements = (4 * b * s * h + 4 * b * s) // whole + (4 * b * s * h + 2 * b * s * f) // t
    extra = 0
    if attention == "math":
        elements += b * (a // t) * s * s
        extra += s * s
        if dropout > 0:
            elements += b * (a // t) * s * s
            extra += b * (a // t) * s * s
    else:
        extra += 4 * b * (a // t) * s
    if dropout > 0:
        extra += 2 * b * s * h // whole
    return elements * e + extra


def torch_activation_bytes(layers: int, seq: int, micro_batch: int, hidden: int, heads: int, vocab: int, *,
                           element_bytes: int = 4, attention: str = "sdpa", dropout: float = 0.0,
                           ffn: int | None = None) -> int:
    """The peak of activation bytes in one step of meshtrain's GPT on one process (`torch`
    accounting; no tp, pp or recompute yet): every block's `torch_activation_bytes_per_layer`,
    plus the embedding's output (and its dropout mask) and the final LayerNorm's output and
    statistics, plus three fp32 tensors of logits' size at the loss — the log-softmax kept for
    backward, and in backward its gradient and the logits' (the loss is computed in fp32
    whatever the precision)."""
    e, b, s, h = element_bytes, micro_batch, seq, hidden
    per_layer = torch_activation_bytes_per_layer(s, b, h, heads, element_bytes=e, attention=attention,
                                                 dropout=dropout, ffn=ffn)
    outside = 2 * b * s * h * e + 2 * b * s * e + 3 * b * s * vocab * 4 + (b * s * h if dropout > 0 else 0)
    return layers * per_layer + outside

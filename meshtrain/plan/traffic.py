"""What one device sends in one training step, per mesh axis: every collective the trainer
issues, as (kind, bytes sent per call, calls), counted as `meshtrain.comm` counts them —
the same ring formulas, so that the plan's `comm_bytes_per_step` is the trainer's.

Per micro-batch, with A = b·s·h activation bytes (s/t of the sequence under SP):

- tp: each block all-reduces A twice in forward (after attention, after the MLP) and twice
  in backward (before the column layers). Under SP each of those is an all-gather and a
  reduce-scatter, and backward gathers each column layer's input once more (Megatron's SP
  keeps its shard, not the gathered input). The vocabulary-parallel embedding reduces its
  output (forward); the head's input is reduced in backward; the loss all-reduces three
  fp32 values per token. Recomputation (full, segments) repeats a region's forward
  all-reduces (reduce-scatters under SP) but its last; under SP its gathers replace the
  ones for the weight gradients. Under SP the gradients of the parameters left whole are summed
  once a step.
- A MoE layer's experts are replicated over tp, outside any region: its block has the
  attention's collectives only. Without SP every tp rank runs the experts of all its
  tokens and their gradients need no sum (but the per-head q/k norms', once a step); under
  SP each routes its share of the sequence, and the experts' gradients are summed over tp
  with every whole parameter's, once a step — their whole size. The balancing loss's
  per-row sums ([rows, 3, E] fp32) are all-reduced over the ranks that split a row's
  tokens (tp under SP, cp) forward and backward, and again when recomputed.
- ep (expert parallelism, `parallel/experts.py`): per MoE layer and micro-batch, each rank
  dispatches its T = b·s/tp tokens' k rows (s: its cp share; /tp with or without SP). With
  the load balanced, (ep-1)/ep of them leave it, d elements each: the dispatch and the
  combine forward, and both again backward, `expert_all_to_all_bytes`; before each forward
  the per-expert counts, an all-to-all of E int64. A recomputed MoE layer (full, segments)
  exchanges its forward again. Without SP, tp splits the replicated tokens before the
  dispatch and all-gathers the outputs after the combine: per MoE layer and micro-batch an
  all-gather of the output forward, and of the input's and the router weights' gradients
  backward (and of the output again when recomputed). The experts' gradients are summed over
  their edp = dp·cp·tp/ep replicas (`edp`), the rest over dp × cp as before.
- pp: an activation forward to the next virtual stage, a gradient back to the previous one.
- dp (`--zero`): 0 all-reduces the gradients once a step; 1 reduce-scatters them once and
  all-gathers the parameters after the update; 2 reduce-scatters every micro-batch's;
  3 all-gathers the parameters before each forward and again before each backward (once
  with `--keep-gathered`) and reduce-scatters every micro-batch's gradients. (With
  `--recompute segments` ZeRO-3 also gathers some blocks a third time — a segment's
  recomputation frees its later blocks before their backward gathers them again — which
  this count leaves out: +21 % of dp bytes on gpt-test.)"""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.ring import all_gather_bytes, all_reduce_bytes


@dataclass(frozen=True)
class Transfer:
    kind: str  # all_reduce | all_gather | reduce_scatter | send
    nbytes: float  # sent by this device per call
    calls: float

    @property
    def total(self) -> float:
        return self.nbytes * self.calls


def _ar(nbytes: float, n: int, calls: float) -> list[Transfer]:
    return [Transfer("all_reduce", all_reduce_bytes(nbytes, n), calls)] if n > 1 and calls else []


def _ag(nbytes: float, n: int, calls: float, kind: str = "all_gather") -> list[Transfer]:
    return [Transfer(kind, all_gather_bytes(nbytes, n), calls)] if n > 1 and calls else []


def _regions(d, stage: int) -> tuple[list[int], list[int]]:
    """Per block of the stage, its tensor-parallel regions (attention and MLP: 2; a MoE
    layer's attention only: 1), and per recomputed unit the reductions its recomputation
    repeats: its forward reductions but the last, when the unit ends with a dense block's
    MLP (non-reentrant checkpointing stops once the last tensor saved for backward is
    rebuilt; the trainer's counts, held equal by a test); all of them when it ends with a
    MoE layer, whose experts save tensors after its attention's reduction."""
    layers = d.layers_on(stage)  # chunk by chunk, as the units are cut
    regions = [1 if d.shape.is_moe(i) else 2 for i in layers]
    repeated, start = [], 0
    for size in d.recomputed_units(stage):
        last = layers[start + size - 1]
        repeated.append(sum(regions[start:start + size]) - (0 if d.shape.is_moe(last) else 1))
        start += size
    return regions, repeated


def aux_sums(d, stage: int) -> tuple[int, int]:
    """(bytes, calls) per micro-batch of the all-reduces of the stage's MoE layers'
    balancing sums over the ranks holding other tokens of the same rows (tp under SP, cp):
    [groups, 3, E] fp32 each, forward and backward, and again when a block is recomputed."""
    sh = d.shape
    if sh.kind != "moe" or not sh.aux_rows:
        return 0, 0
    layers = [i for i in d.layers_on(stage) if sh.is_moe(i)]
    calls = len(layers) * (3 if d.recompute_mode in ("full", "segments") else 2)
    return d.micro_batch // sh.aux_rows * 3 * sh.experts * 4, calls


def tp_transfers(d, stage: int) -> list[Transfer]:
    """Tensor-parallel traffic of pipeline stage `stage` (`d`: a `planner.Device`)."""
    lay, t = d.layout, d.layout.tp
    if t == 1:
        return []
    m, act = lay.microbatches, d.micro_batch * d.seq * d.shape.hidden * d.element_bytes
    ends = int(d.has_embedding(stage)) + int(d.has_head(stage))
    # What recomputation repeats of a unit of blocks: its forward reductions but the last
    # (`_regions`).
    regions, repeated = _regions(d, stage)
    out = []
    if lay.sp:
        # forward: gather before attention and MLP, scatter after; backward: the reverse, and
        # each column layer gathers its input again for its weight gradient. The embedding
        # scatters (backward: gathers), the head gathers (backward: scatters, gathers again).
        # A recomputed block gathers its inputs again in the recomputation instead of for its
        # weight gradients: as many gathers; its scatters but the unit's last run again.
        gathers = 3 * sum(regions) + 2 * int(d.has_head(stage)) + int(d.has_embedding(stage))
        scatters = 2 * sum(regions) + ends + sum(repeated)
        out += _ag(act, t, m * gathers) + _ag(act, t, m * scatters, "reduce_scatter")
        out += _ar(d.whole_params(stage) * d.grad_bytes, t, 1)
        nbytes, calls = aux_sums(d, stage)
        out += _ar(nbytes, t, m * calls)
    else:
        out += _ar(act, t, m * (2 * sum(regions) + ends + sum(repeated)))
        out += _ar(d.partial_params(stage) * d.grad_bytes, t, 1)  # a MoE's per-head q/k norms
    if d.has_head(stage):
        out += _ar(d.micro_batch * d.seq * 4, t, 3 * m)  # the loss's max, target logit and sum of exponentials
    return out


def pp_transfers(d, stage: int) -> list[Transfer]:
    """Activations sent forward and gradients sent back by pipeline stage `stage`."""
    lay = d.layout
    if lay.pp == 1:
        return []
    seq = d.seq // lay.tp if lay.sp else d.seq
    act = d.micro_batch * seq * d.shape.hidden * d.element_bytes
    m, v = lay.microbatches, lay.chunks
    forward = v * m - (m if stage == lay.pp - 1 else 0)  # the last virtual stage sends nothing on
    backward = v * m - (m if stage == 0 else 0)  # nor does the first send back
    return [Transfer("send", act, forward + backward)]


def dp_transfers(d, stage: int) -> list[Transfer]:
    """Data-parallel traffic of a device of pipeline stage `stage`, by ZeRO stage."""
    # the parameters' replicas: dp × cp
    return zero_transfers(d, d.dense_params_on(stage), d.replicas, d.layout.zero)


def zero_transfers(d, params: int, n: int, zero: int) -> list[Transfer]:
    """What ZeRO stage `zero` (or plain DP) sends for `params` parameters replicated over n ranks."""
    lay = d.layout
    grads, weights = params * d.grad_bytes, params * d.param_bytes
    m = lay.microbatches
    if zero == 0:
        return _ar(grads, n, 1)
    if zero == 1:
        return _ag(grads, n, 1, "reduce_scatter") + _ag(weights, n, 1)
    if zero == 2:
        return _ag(grads, n, m, "reduce_scatter") + _ag(weights, n, 1)
    gathers = m * (1 if lay.keep_gathered else 2)
    return _ag(weights, n, gathers) + _ag(grads, n, m, "reduce_scatter")


def cp_transfers(d, stage: int) -> list[Transfer]:
    """Context parallelism's traffic of a device of stage `stage`: the ring's keys, values and
    their gradients, or all-to-all attention's four tensors each way, for the stage's blocks
    (a recompute mode runs the attention's forward again: each but none)."""
    lay = d.layout
    if lay.cp == 1:
        return []
    sh, rows, seq = d.shape, d.micro_batch * lay.microbatches, d.work.seq
    heads, kv = sh.heads // lay.tp, sh.kv_width // lay.tp
    width, recomputed = heads * sh.head_size, lay.recompute != "none"
    if lay.cp_mode == "ulysses":
        sent = all_to_all_attention_bytes(d.blocks_on(stage), rows, seq, width, kv, lay.cp,
                                          element_bytes=d.element_bytes, recomputed=recomputed)
        nbytes, calls = aux_sums(d, stage)
        return [Transfer("all_to_all", sent, 1)] + _ar(nbytes, lay.cp, lay.microbatches * calls)
    sent = ring_attention_bytes(d.blocks_on(stage), rows, seq, kv, lay.cp, element_bytes=d.element_bytes,
                                recomputed=recomputed)
    nbytes, calls = aux_sums(d, stage)
    return [Transfer("send", sent, 1)] + _ar(nbytes, lay.cp, lay.microbatches * calls)


def expert_all_to_all_bytes(tokens: int, top_k: int, hidden: int, ep: int, *, element_bytes: int,
                            passes: int = 4) -> float:
    """What one rank sends over ep for one MoE layer's micro-batch of `tokens` tokens, with
    the load balanced: (ep-1)/ep of its tokens' k rows of `hidden` elements, `passes` times
    (dispatch and combine, forward and backward: 4; 6 when the forward is recomputed)."""
    return passes * tokens * top_k * (ep - 1) / ep * hidden * element_bytes


def ep_transfers(d, stage: int) -> list[Transfer]:
    """Expert parallelism's all-to-alls of a device of stage `stage` (balanced load)."""
    lay, sh = d.layout, d.shape
    if lay.ep == 1:
        return []
    layers = sh.moe_in(d.layers_on(stage))
    recomputed = d.recompute_mode in ("full", "segments")
    tokens = d.micro_batch * d.seq // lay.tp
    rows = expert_all_to_all_bytes(tokens, sh.top_k, sh.hidden, lay.ep, element_bytes=d.element_bytes,
                                   passes=6 if recomputed else 4)
    counts = all_gather_bytes(sh.experts * 8, lay.ep) * (2 if recomputed else 1)
    return [Transfer("all_to_all", rows + counts, lay.microbatches * layers)] if layers else []


def ep_tp_transfers(d, stage: int) -> list[Transfer]:
    """Without SP, tp's share of expert parallelism: the outputs all-gathered forward, the
    inputs' and router weights' gradients backward (`parallel/experts.py`)."""
    lay, sh = d.layout, d.shape
    if lay.ep == 1 or lay.tp == 1 or lay.sp:
        return []
    layers = sh.moe_in(d.layers_on(stage))
    tokens = d.micro_batch * d.seq
    act = tokens * sh.hidden * d.element_bytes
    gathers = 3 if d.recompute_mode in ("full", "segments") else 2
    return (_ag(act, lay.tp, lay.microbatches * layers * gathers)
            + _ag(tokens * sh.top_k * 4, lay.tp, lay.microbatches * layers))


def edp_transfers(d, stage: int) -> list[Transfer]:
    """The experts' chunks synchronised over their replicas (edp = dp·cp·tp/ep) as the rest
    over dp × cp: summed once a step, or by the ZeRO stage's collectives."""
    if d.layout.ep == 1:
        return []
    return zero_transfers(d, d.expert_params_on(stage), d.edp, d.expert_zero)


def transfers(d, stage: int) -> dict[str, list[Transfer]]:
    out = {"dp": dp_transfers(d, stage), "tp": tp_transfers(d, stage) + ep_tp_transfers(d, stage),
           "pp": pp_transfers(d, stage), "cp": cp_transfers(d, stage), "ep": ep_transfers(d, stage),
           "edp": edp_transfers(d, stage) if d.layout.ep > 1 else []}  # every axis train's --json names
    return out


def bytes_per_axis(by_axis: dict[str, list[Transfer]]) -> dict[str, float]:
    return {axis: sum(x.total for x in xs) for axis, xs in by_axis.items()}


def ring_attention_bytes(layers: int, rows: int, seq: int, kv_width: int, cp: int, *, element_bytes: int,
                         recomputed: bool = False) -> int:
    """What one rank sends on the cp ring in a step (`meshtrain.parallel.context`): per
    layer, the keys and values forward, 2·b·s·d_kv·(cp−1)/cp elements of `element_bytes`
    (again when recomputation re-runs the forward); backward the same again, plus their
    fp32 gradients' cp hops, 2·b·s·d_kv·4 bytes. `rows`: the rank's sequences in the step
    (all its micro-batches); d_kv = n_kv · head_dim."""
    if cp == 1:
        return 0
    keys_values = 2 * rows * seq * kv_width * (cp - 1) // cp * element_bytes
    return layers * (keys_values * (3 if recomputed else 2) + 2 * rows * seq * kv_width * 4)


def all_to_all_attention_bytes(layers: int, rows: int, seq: int, width: int, kv_width: int, cp: int, *,
                               element_bytes: int, recomputed: bool = False) -> int:
    """What one rank sends under all-to-all attention (Ulysses) in a step: per layer and way
    (forward; backward; the recomputed forward again), q and the output (`width` each: n_heads
    · head_dim), k and v (`kv_width`) of its b·s/cp tokens, (cp−1)/cp of them leaving."""
    if cp == 1:
        return 0
    way = rows * (seq // cp) * (2 * width + 2 * kv_width) * (cp - 1) // cp * element_bytes
    return layers * way * (3 if recomputed else 2)

"""A pipeline stage's activation bytes over a step, analytically: how many micro-batches it
holds at once, and the peak of what they keep (`torch` accounting), walked from the
schedule's own instruction lists, from one block's terms (`activations.py`).

The first pipeline stage holds the activations of `in_flight` micro-batches at once: p under
1F1B whatever p is, scaled by 1 + (p−1)/(p·v) when interleaved (Narayanan et al. 2021)."""

from __future__ import annotations

from functools import lru_cache

from meshtrain.parallel.options import parse_recompute
from meshtrain.parallel.pipeline import schedules as S
from meshtrain.plan.activations import block_parts, recompute_units, weight_store_bytes
from meshtrain.plan.block_terms import LlamaDims, MoEDims
from meshtrain.plan.model_states import chunk_layers


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


@lru_cache(maxsize=4096)
def _chunks_at_backwards(schedule: str, pp: int, stage: int, microbatches: int,
                         chunks: int) -> tuple[tuple[int, tuple[int, ...], int, int, int], ...]:
    """The distinct moments of the stage's backwards (the peak is their largest, so a moment
    repeated in the steady state counts once), by walking the stage's instruction list: its
    chunk; the micro-batches each chunk holds then (forwarded and not yet backwarded, the one
    being backwarded included); under the zero-bubble schedule the micro-batches whose input
    pass is done and whose weight pass is not (holding only the weight-gradient store's
    pairs; on the first virtual stage, which runs its backward whole in the weight pass, a
    micro-batch is held until then); the activations received and still held (a chunk's
    input, but the first virtual stage's); the outputs not yet sent (interleaved sends a
    step's forward output after its backward) and the messages sent and not yet known
    complete — outputs and input gradients, which the engine frees when a later group with
    a receive (or the step's end) has waited for them (`transport.py`)."""

    if pp == 1:
        return ((0, (1,), 0, 0, 0, False),)
    last = pp * chunks - 1
    held, stored, received, unsent, in_flight, found = [0] * chunks, 0, 0, 0, 0, []
    steps = S.compute_steps(schedule, stage, pp, microbatches, chunks)
    for op in S.with_communication(stage, steps, pp, chunks):
        if isinstance(op, S.Transfers):
            outputs = sum(isinstance(t, S.SendActivation) for t in op.ops)
            unsent -= outputs
            if any(isinstance(t, (S.RecvActivation, S.RecvGrad)) for t in op.ops):
                in_flight = 0  # waited for as a whole, with every group before it
            else:
                in_flight += len(op.ops)  # sends only: waited for later
            continue
        receives = op.chunk * pp + stage > 0
        if isinstance(op, S.Forward):
            held[op.chunk] += 1
            received += receives
            unsent += op.chunk * pp + stage < last  # an output to send (in the same step as a backward)
        elif isinstance(op, (S.Backward, S.BackwardInput)):
            found.append((op.chunk, tuple(held), stored, received, unsent + in_flight, False))
        elif receives and isinstance(op, S.BackwardWeight):  # a split backward's weight pass
            found.append((op.chunk, tuple(held), stored, received, unsent + in_flight, True))
        whole = isinstance(op, S.Backward) or (not receives and isinstance(op, S.BackwardWeight))
        if whole or (receives and isinstance(op, S.BackwardInput)):
            held[op.chunk] -= 1
            received -= receives
        if receives and isinstance(op, (S.BackwardInput, S.BackwardWeight)):  # a split backward's store
            stored += 1 if isinstance(op, S.BackwardInput) else -1
    return tuple(dict.fromkeys(found))


def torch_stage_activation_bytes(layers: int, seq: int, micro_batch: int, hidden: int, heads: int, vocab: int, *,
                                 element_bytes: int = 4, attention: str = "sdpa", dropout: float = 0.0,
                                 ffn: int | None = None, tp: int = 1, sp: bool = False, recompute: str = "none",
                                 pp: int = 1, stage: int = 0, schedule: str = "1f1b", microbatches: int = 1,
                                 chunks: int = 1, stage_layers: list[int] | None = None,
                                 llama: LlamaDims | None = None, cp_mode: str | None = None,
                                 fused_blocks: bool = False, moe: MoEDims | None = None) -> int:
    """The peak of activation bytes in one step on one rank of pipeline stage `stage`
    (`torch` accounting): the largest of the moments below, for the micro-batch size b the
    stage runs (the rank's batch ÷ microbatches), `layers` the whole model's blocks (the
    stage's are cut as `split_layers` does). Parts are `block_parts`' (per block) and:

    - a micro-batch's forward keeps K: on the first stage the embedding's output (its dropout
      mask, the positions, int64; under tp the vocabulary-parallel lookup's local ids, 2·8
      bytes a token, and its mask), its blocks' `recompute_kept_bytes`, and on the last the
      final LayerNorm's output and statistics and what the loss keeps, the fp32 logits
      (held until that micro-batch's backward: under GPipe the last stage holds m of them);
    - a non-first stage keeps the received activations of the micro-batches in flight; a
      chunk's output (and an input gradient sent back) lives until its send is known
      complete, when a later group with a receive has been waited for: the messages sent and
      not yet waited for at that backward, one activation's size each;
    - at the backward of micro-batch k (order by the schedule), the n micro-batches
      in flight (n = min(p − stage, m − k) under 1F1B) hold K each — under the interleaved
      schedule the K of the chunk each sits in, each chunk a run of its own (the first
      stage's first chunk holds the embedding's share, the last stage's last chunk the
      loss's), walked instruction by instruction (`_chunks_at_backwards`); that backward
      holds the gradient of its chunk's output and, at its largest:
        - the loss (last stage): two fp32 tensors of the logits' size, the logits kept for
          backward and, in its forward, their shifted exponentials (in backward: the
          logits' gradient), four fp32 numbers per token, and under bf16 the bf16 logits,
          which the caller holds until the loss returns (`meshtrain.loss`); under tp three of the local
          logits' size (split by the vocabulary: the vocabulary-parallel cross-entropy keeps
          its probabilities, and holds their copy and the logits' gradient), with each
          token's local target and mask, 9 bytes, and five fp32 numbers at its peak;
        - no recompute: the last block's `backward_extra`, its saved tensors all alive;
        - a recomputed unit (full: a block; segments: K blocks): the inputs of the units
          before it and its own, its blocks recomputed (their `kept`, less the last block's
          output: nothing saves it), and the last block's `backward_extra` (full: the
          block's `recomputed_peak`, its MLP in chunks); or under math, the recomputation
          at the last block's softmax (`forward_peak`, the earlier blocks of the unit
          recomputed);
    - under math, the forward of the last block at its softmax (`forward_peak`), the earlier
      blocks' K share alive;
    - under the zero-bubble schedule, on every stage but the first (which runs each backward
      whole, in its weight pass): a micro-batch between its input and weight passes holds
      only its pairs in the weight-gradient store (`weight_store_bytes` a block, and on the
      last stage the head's input and the logits' gradient, b·s·(h + V/t)·e); during its
      input pass it holds the head's pair, and a recomputed unit's moment the pairs of the
      units after it; and each weight pass is a moment of its own: every pair still kept
      (its own micro-batch's included), the other micro-batches' K and one ∇W (the largest
      weight's). Measured on gpt-test at pp 2, m 4: exact with no recompute; 2–5 % low on
      the last stage under recompute, whose input pass frees recomputed tensors while the
      store fills, a moment the formula does not follow.

    A MoE model (`moe`, with `llama`) has blocks of two kinds, its dense layers' and its MoE
    layers' (`block_parts` of each): a stage sums what its own blocks keep, and each block's
    backward is a moment of its own (the blocks before it alive, its own at its largest):
    the largest need not be the last block's when the kinds differ.

    What is left out: scalars (the loss), the loss's transients of the targets, the bias
    gradients' sums, dropout's transients in the forward."""
    e, b, s, h = element_bytes, micro_batch, seq, hidden
    t = tp
    w = t if sp else 1
    terms = dict(element_bytes=e, attention=attention, dropout=dropout, ffn=ffn, tp=t, sp=sp, llama=llama,
                 cp_mode=cp_mode, fused_blocks=fused_blocks)
    parts = block_parts(s, b, h, heads, **terms)
    sparse = block_parts(s, b, h, heads, moe=moe, **terms) if moe is not None else parts
    out = parts["out"]
    recompute_mode = parse_recompute(recompute)[0]
    runs = chunk_layers(layers, pp, stage, chunks, tuple(stage_layers) if stage_layers else None)

    def part(layer: int) -> dict[str, int]:
        return sparse if moe is not None and moe.is_moe(layer) else parts
    ids = 17 * b * s if t > 1 else 0  # the vocabulary-parallel lookup's local ids (two int64 copies), its mask
    # the last stage keeps, per micro-batch until its backward, the final LayerNorm's output and
    # statistics and what the loss keeps: the logits, or under tp the local probabilities
    # (fp32, the local logits' size), with each token's local target (int64) and its mask; at
    # the loss it holds one more such tensor (the logits' gradient), under tp two (the
    # probabilities' copy too) and five fp32 numbers per token (max, target logit, sum, log, term)
    kept_loss = b * s * (vocab // t) * 4 + (9 * b * s if t > 1 else 0)
    # at the loss (its forward: the logits kept, their shifted exponentials, a few fp32 numbers
    # per token, and under bf16 the bf16 logits, which the caller still holds)
    # (one process in fp32: the ignored targets are always masked, never asked about — no host
    # sync — so the mask, a byte a token, and the masked targets' int64 copy are there too; in
    # bf16 the moment is the logits' gradient cast back, after they are freed)
    masked = 9 * b * s if e == 4 else 0
    loss = ((2 * b * s * (vocab // t) * 4 + 20 * b * s) if t > 1 else b * s * vocab * 4 + 16 * b * s + masked)
    loss += b * s * (vocab // t) * e if e < 4 else 0  # the bf16 logits the caller holds

    split = schedule == "zb" and stage > 0  # the first stage runs each backward whole
    dense_pairs = weight_store_bytes(s, b, h, element_bytes=e, ffn=ffn, tp=t, llama=llama)
    sparse_pairs = weight_store_bytes(s, b, h, element_bytes=e, ffn=ffn, tp=t, llama=llama, moe=moe, sp=sp)

    def pairs(layer: int) -> int:
        return sparse_pairs if moe is not None and moe.is_moe(layer) else dense_pairs

    def micro_batch(run: tuple[int, ...], first: bool, last: bool) -> tuple[int, int]:
        """(what a micro-batch keeps through the blocks of `run`, its live bytes at its
        backward's largest moment); `first`: they start from the embedding, `last`: end at
        the loss."""
        blocks = len(run)
        kinds = [part(i) for i in run]
        units = recompute_units(blocks, recompute)
        # what of a run's first input and last output its neighbours keep: a recomputed unit's
        # checkpoint keeps its input; else a GPT's LayerNorm keeps it, a bf16 Llama's RMSNorm
        # only its fp32 copy (in the block's `kept`)
        tail = out if units else parts["tail"]
        if llama:  # no position table; the final RMSNorm keeps as a block's does
            before = (tail + ids) if first else 0
            after = (2 * out + 4 * b * s // w + (4 * b * s * h // w if e < 4 else 0) + kept_loss) if last else 0
        else:
            before = (out + 8 * s + ids + (b * s * h // w if dropout > 0 else 0)) if first else 0
            after = (out + 2 * b * s * e // w + kept_loss) if last else 0
        key = "selective" if recompute == "selective" else "kept"
        kept_blocks = len(units) * out if units else sum(k[key] for k in kinds)
        per_mb = before + kept_blocks + after
        grad = out  # the gradient of the stage's output (received, or the final LayerNorm's)
        if not last or (units and not parts["tail"]):
            # its output is freed once sent (counted apart while the send is in flight), or
            # the bf16 Llama's final RMSNorm keeps only its fp32 copy
            per_mb -= tail
        if units:
            moments, earlier, start = [], 0, 0
            chunked_mlp = recompute_mode == "full"  # recompute.py runs its MLP in two chunks of rows
            for size in units:
                unit, start = kinds[start:start + size], start + size
                if chunked_mlp:
                    redo = unit[0]["recomputed_peak"]
                else:  # each block's backward, the unit's earlier blocks recomputed and alive
                    redo = _largest_backward(unit, "recomputed") - parts["tail"]
                again = sum(k["recomputed"] for k in unit[:-1]) + unit[-1]["forward_peak"]
                later = sum(pairs(i) for i in run[start:]) if split else 0  # kept by then by a split backward
                moments.append(earlier * out + max(redo, again) + later)
                earlier += 1
            current = before + max(moments) + grad
        else:  # each block's backward, the blocks before it alive
            current = before + grad - tail + _largest_backward(kinds, key)
        # a split backward (zero-bubble, but on the first stage) keeps the head's pair in the
        # store from the loss's backward on: the logits' gradient is still held while the
        # micro-batch's blocks backward
        if split and last:
            current += b * s * (vocab // t) * e
        current = max(current, per_mb + (loss if last else 0))
        if attention == "math":  # the forward of the last block, at its softmax
            share = (len(units) - 1) * out if units else sum(k[key] for k in kinds[:-1])
            current = max(current, before + share + kinds[-1]["forward_peak"])
        return per_mb, current

    # each chunk of the stage (one, but under the interleaved schedule), as a run of its own
    chunk = [micro_batch(run, stage == 0 and c == 0, stage == pp - 1 and c == len(runs) - 1)
             for c, run in enumerate(runs)]
    # zero-bubble's store: per micro-batch between its passes, every block's linear layers'
    # pairs and, on the last stage, the head's (its input, whole under SP, and the logits' gradient)
    last_stage = stage == pp - 1
    held_layers = [i for run in runs for i in run]
    store = sum(pairs(i) for i in held_layers) + (b * s * (h + vocab // t) * e if last_stage else 0)
    f = ffn or 4 * h
    widest = h * f if any(part(i) is parts for i in held_layers) else h * (llama.q_width if llama else h)
    weight_grad = max(widest, h * (vocab // t) if last_stage else 0) * e // t  # the largest ∇W a weight pass forms
    peak = 0
    for c, held, stored, received, sent, weight in _chunks_at_backwards(schedule, pp, stage, microbatches, chunks):
        # the micro-batches in flight keep theirs, the one backwarded is at its largest; those
        # waiting for their weight pass their pairs; the received activations in flight and
        # the messages sent and not yet waited for. At a weight pass: every pair still kept
        # (its own micro-batch's included) and one ∇W.
        kept = sum(n * chunk[i][0] for i, n in enumerate(held)) + stored * store + (received + sent) * out
        peak = max(peak, kept + weight_grad if weight else kept - chunk[c][0] + chunk[c][1])
    return peak + parts["table"]  # one RoPE table per rank, whatever it holds of the blocks


def _largest_backward(kinds: list[dict[str, int]], key: str) -> int:
    """The largest of each block's backward over a run of blocks (`block_parts` each): the
    blocks before it keep `key`'s bytes, it keeps its own and its `backward_extra`."""
    before, largest = 0, None
    for k in kinds:
        before += k[key]
        moment = before + k["backward_extra"]
        largest = moment if largest is None else max(largest, moment)
    return largest


def torch_activation_bytes(layers: int, seq: int, micro_batch: int, hidden: int, heads: int, vocab: int, *,
                           element_bytes: int = 4, attention: str = "sdpa", dropout: float = 0.0,
                           ffn: int | None = None, **layout) -> int:
    """The peak of activation bytes in one step of meshtrain's GPT on one rank (`torch`
    accounting): `torch_stage_activation_bytes`, whose keyword arguments `layout` takes (tp,
    sp, recompute, pp, stage, schedule, microbatches, chunks, stage_layers); on one process
    with no recompute, every block's `torch_activation_bytes_per_layer`, plus the embedding's
    output (its dropout mask, the positions) and the final LayerNorm's output and
    statistics, plus two fp32 tensors of logits' size at the loss — the logits kept for
    backward, and in backward their gradient (the loss is computed in fp32 whatever the
    precision)."""
    return torch_stage_activation_bytes(layers, seq, micro_batch, hidden, heads, vocab, element_bytes=element_bytes,
                                        attention=attention, dropout=dropout, ffn=ffn, **layout)

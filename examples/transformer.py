"""A small transformer of your own — fused QKV with grouped-query attention, a SwiGLU MLP
with gate and up fused, RMSNorm — under tensor parallelism (a plan of module names to
styles), pipeline parallelism (stages cut from outside) and both, on bytes of this file.

    torchrun --nproc-per-node=2 examples/transformer.py      # tp 2, then pp 2
    torchrun --nproc-per-node=4 examples/transformer.py      # tp 2 × pp 2, then dp 2 × tp 2
    meshtrain verify --model examples.transformer:factory --tp 2
"""

import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import meshtrain

VOCAB, D, HEADS, KV_HEADS, HIDDEN, LAYERS, SEQ = 256, 64, 4, 2, 128, 4, 32
HEAD_DIM = D // HEADS


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.n_heads, self.n_kv_heads = HEADS, KV_HEADS  # the plan divides these by tp
        self.qkv = nn.Linear(D, (HEADS + 2 * KV_HEADS) * HEAD_DIM, bias=False)
        self.o = nn.Linear(HEADS * HEAD_DIM, D, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split([self.n_heads * HEAD_DIM, self.n_kv_heads * HEAD_DIM,
                                     self.n_kv_heads * HEAD_DIM], dim=-1)
        q = q.view(b, t, self.n_heads, HEAD_DIM).transpose(1, 2)
        k, v = (z.view(b, t, self.n_kv_heads, HEAD_DIM).transpose(1, 2) for z in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(b, t, self.n_heads * HEAD_DIM))


class SwiGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up = nn.Linear(D, 2 * HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, D, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_norm, self.attn, self.mlp_norm, self.mlp = nn.RMSNorm(D), Attention(), nn.RMSNorm(D), SwiGLU()

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, D), nn.Embedding(SEQ, D)

    def forward(self, ids):
        return self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = Embed()
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.head = nn.RMSNorm(D), nn.Linear(D, VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


# Tensor parallelism: attention split by heads (q, k and v each split per head group, the
# head counts divided), the MLP by hidden features (gate and up together), then summed.
TP_PLAN = meshtrain.TensorPlan({
    "layers.*.attn": (meshtrain.REGION, meshtrain.Heads("n_heads", "n_kv_heads")),
    "layers.*.attn.qkv": meshtrain.Fused((HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM), unit=HEAD_DIM),
    "layers.*.attn.o": meshtrain.ROW,
    "layers.*.mlp": meshtrain.REGION,
    "layers.*.mlp.gate_up": meshtrain.Fused((HIDDEN, HIDDEN)),
    "layers.*.mlp.down": meshtrain.ROW,
})
# Pipeline parallelism: the embedding on the first stage, the layers split evenly, the norm
# and head on the last; what passes between stages is [rows, seq, D].
PIPELINE = meshtrain.PipelinePlan(("embed",), "layers", ("norm", "head"), lambda rows, seq: (rows, seq, D))


def make_model():
    torch.manual_seed(0)
    return Transformer()


def adamw(named_params):
    matrices = [p for _, p in named_params if len(meshtrain.full_shape(p)) >= 2]
    others = [p for _, p in named_params if len(meshtrain.full_shape(p)) < 2]
    return torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}],
                             lr=3e-3, betas=(0.9, 0.95))


def batch(step, batch_size):
    """Windows of this file's bytes, chosen by the step: the next byte is the target."""
    text = torch.tensor(list(Path(__file__).read_bytes()), dtype=torch.long)
    starts = torch.randint(0, len(text) - SEQ - 1, (batch_size,), generator=torch.Generator().manual_seed(step))
    windows = torch.stack([text[s:s + SEQ + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def factory():
    return meshtrain.Recipe(make_model, batch=batch, loss_fn=meshtrain.cross_entropy, tp_plan=TP_PLAN,
                            pipeline=PIPELINE, optimizer=adamw)


def layouts(world):
    """(axes, options) of the layouts this many ranks run."""
    if world == 4:
        return [({"tp": 2, "pp": 2}, {"tp_plan": TP_PLAN, "pipeline": PIPELINE, "microbatches": 2}),
                ({"dp": 2, "tp": 2}, {"tp_plan": TP_PLAN})]
    return [({"tp": world}, {"tp_plan": TP_PLAN}),
            ({"pp": world}, {"pipeline": PIPELINE, "microbatches": 2, "schedule": "1f1b"})]


def main(steps=40, batch_size=8):
    import torch.distributed as dist
    world = dist.get_world_size() if dist.is_initialized() else int(__import__("os").environ.get("WORLD_SIZE", 1))
    failed = 0
    for axes, options in layouts(world):
        mesh = meshtrain.init(**axes)
        job = meshtrain.parallelize(make_model(), mesh, optimizer=adamw, loss_fn=meshtrain.cross_entropy,
                                    clip_grad_norm=1.0, **options)
        for step in range(steps):
            out = job.step(*batch(step, batch_size))
        report = meshtrain.verify(make_model, [batch(s, batch_size) for s in range(3)], mesh=mesh, optimizer=adamw,
                                  loss_fn=meshtrain.cross_entropy, clip_grad_norm=1.0, **options)
        failed += not report.passed
        if mesh.is_main:
            print(f"{axes}: loss after {steps} steps {out.loss:.3f}; verify {report}")
    return 1 if failed else 0


if __name__ == "__main__":
    steps = [int(a.split("=")[1]) for a in sys.argv[1:] if a.startswith("--steps=")]
    sys.exit(main(*steps))

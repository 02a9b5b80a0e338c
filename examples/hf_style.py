"""A model in Hugging Face's style — keyword inputs, an output that carries its own loss —
in bf16 (fp32 master weights, gradients reduced in fp32) with full activation
recomputation, under data parallelism. `job.step(batch_dict)` calls `model(**batch)` and
trains on `output.loss`: a mean the model took itself, whose cross-entropy meshtrain sees
as it runs, turns into a sum and counts, so every layout trains on the global batch's mean.

    torchrun --nproc-per-node=2 examples/hf_style.py
    meshtrain verify --model examples.hf_style:factory --dp 2 --precision bf16 --recompute full
"""

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import meshtrain

VOCAB, D, LAYERS, SEQ = 256, 64, 3, 32


@dataclass
class CausalLMOutput:
    loss: torch.Tensor | None
    logits: torch.Tensor


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x):
        h = self.norm(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device, dtype=x.dtype)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(x)


class TinyCausalLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, D)
        self.embed_positions = nn.Embedding(SEQ, D)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.lm_head = nn.Linear(D, VOCAB)

    def forward(self, input_ids, labels=None):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embed_tokens(input_ids) + self.embed_positions(positions)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(x)
        loss = None
        if labels is not None:  # labels are the inputs; each position predicts the next
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return CausalLMOutput(loss=loss, logits=logits)


def make_model():
    torch.manual_seed(0)
    return TinyCausalLM()


def adamw(named_params):
    return torch.optim.AdamW((p for _, p in named_params), lr=2e-3, weight_decay=0.0)


def batch(step, batch_size):
    text = torch.tensor(list(Path(__file__).read_bytes()), dtype=torch.long)
    starts = torch.randint(0, len(text) - SEQ, (batch_size,), generator=torch.Generator().manual_seed(step))
    ids = torch.stack([text[s:s + SEQ] for s in starts.tolist()])
    return {"input_ids": ids, "labels": ids}


def factory():
    return meshtrain.Recipe(make_model, batch=lambda step, size: (batch(step, size), None), loss_fn=None,
                            optimizer=adamw)


def main(steps=60, batch_size=8):
    mesh = meshtrain.init()
    options = dict(optimizer=adamw, loss_fn=None, precision="bf16", recompute="full", clip_grad_norm=1.0)
    job = meshtrain.parallelize(make_model(), mesh, **options)
    for step in range(steps):
        out = job.step(batch(step, batch_size))
        if mesh.is_main and (step + 1) % 20 == 0:
            print(f"step {step + 1}: loss {out.loss:.4f}")
    report = meshtrain.verify(make_model, [batch(s, batch_size) for s in range(6)], mesh=mesh, **options)
    if mesh.is_main:
        print(f"verify (dp={mesh.size('dp')}, bf16 + full recompute, against fp32 one process): {report}")
    return 0 if report.passed else 1


if __name__ == "__main__":
    steps = [int(a.split("=")[1]) for a in sys.argv[1:] if a.startswith("--steps=")]
    sys.exit(main(*steps))

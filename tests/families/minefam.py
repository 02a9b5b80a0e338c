"""A model family of a user's own, shipped as a plugin package (tests/test_family_plugin.py
puts this folder, with a dist-info declaring the entry point, on PYTHONPATH): a model, its
specs and a preset, its initial weights, a tensor-parallel plan and a pipeline plan — and no
file of meshtrain edited."""

from dataclasses import dataclass

import meshtrain
from meshtrain.recipes import Family


@dataclass(frozen=True)
class MixerSpec:
    n_layers: int
    d_model: int
    expand: int = 4



def _modules():
    import torch.nn as nn

    class FeedForward(nn.Module):
        def __init__(self, d: int, width: int):
            super().__init__()
            self.up, self.act, self.down = nn.Linear(d, width), nn.GELU(), nn.Linear(width, d)

        def forward(self, x):
            return self.down(self.act(self.up(x)))

    class MixerBlock(nn.Module):
        def __init__(self, spec: MixerSpec):
            super().__init__()
            self.norm = nn.LayerNorm(spec.d_model)
            self.ff = FeedForward(spec.d_model, spec.expand * spec.d_model)

        def forward(self, x):
            return x + self.ff(self.norm(x))

    class Mixer(nn.Module):
        """Token embeddings, residual feed-forward blocks, a final norm and an untied head."""

        def __init__(self, spec: MixerSpec, vocab_size: int):
            super().__init__()
            self.embed = nn.Embedding(vocab_size, spec.d_model)
            self.blocks = nn.ModuleList(MixerBlock(spec) for _ in range(spec.n_layers))
            self.norm = nn.LayerNorm(spec.d_model)
            self.head = nn.Linear(spec.d_model, vocab_size, bias=False)

        def forward(self, idx):
            x = self.embed(idx)
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))
    return Mixer


TP_PLAN = meshtrain.TensorPlan({
    "embed": meshtrain.VOCAB,
    "blocks.*.ff": meshtrain.REGION,
    "blocks.*.ff.up": meshtrain.COLUMN,
    "blocks.*.ff.down": meshtrain.ROW,
    "head": (meshtrain.REGION, meshtrain.COLUMN),
}, vocab_parallel_loss=True)


class MixerFamily(Family):
    name, spec_type = "mixer", MixerSpec
    presets = {"mixer-test": MixerSpec(n_layers=4, d_model=16)}

    def build(self, spec, *, vocab_size=256, **_):
        return _modules()(spec, vocab_size)

    def owns(self, model):
        return type(model).__name__ == "Mixer"

    def init_rules(self, model):
        rules = {}
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                rules[name] = ("normal", 0.02)
            else:
                rules[name] = ("ones",) if name.endswith("norm.weight") else ("zeros",)
        return rules

    def tp_plan(self, spec):
        return TP_PLAN

    def pipeline_plan(self, spec):
        d = spec.d_model
        return meshtrain.PipelinePlan(("embed",), "blocks", ("norm", "head"), lambda b, s: (b, s, d))

    def blocks(self, spec):
        return spec.n_layers

    def tp_splits(self, spec, vocab_size):
        return [(spec.expand * spec.d_model, "feed-forward width"), (vocab_size, "vocabulary (--vocab-size)")]


FAMILY = MixerFamily()


def _draw(name, tensor, generator):
    """The family's rules as `parallelize(init=)` takes them: a parameter's full tensor, filled."""
    if tensor.dim() >= 2:
        tensor.normal_(0.0, 0.02, generator=generator)
    else:
        tensor.fill_(1.0 if name.endswith("norm.weight") else 0.0)


def meta_recipe():
    """The same model as a user's `--model minefam:meta_recipe`: built on the meta device (its
    `init` given), so each rank draws only its part."""
    spec = MixerSpec(n_layers=4, d_model=16)
    return meshtrain.Recipe(make_model=lambda: _modules()(spec, 256), init=_draw, tp_plan=TP_PLAN,
                            pipeline=FAMILY.pipeline_plan(spec))

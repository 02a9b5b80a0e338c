"""Hugging Face folders in and out for the Llama model: `load_hf(dir)` reads `config.json`
and `model.safetensors` (or a sharded index) into a plain `Llama`; `save_hf(model, dir)`
writes a folder `transformers.AutoModelForCausalLM.from_pretrained` loads as is. The module
names are HF's without `model.`, so both ways are a rename. What the model cannot represent
(biases, other RoPE types, another architecture, Meta's original format) is refused in one
line naming the key."""

from __future__ import annotations

import json
from pathlib import Path

from meshtrain.models.presets import LlamaSpec, RopeScaling

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
ROPE_TYPES = ("default", "llama3", "linear")


class HFError(ValueError):
    """A folder meshtrain cannot read as a Llama model: one line naming what and why."""


def spec_from_config(config: dict, where: str = CONFIG) -> tuple[LlamaSpec, int]:
    """(spec, vocabulary size) of a Hugging Face Llama `config.json`, in both the current
    (`rope_parameters`) and the older (`rope_theta`, `rope_scaling`) spellings."""
    archs = config.get("architectures") or []
    if config.get("model_type") != "llama" and "LlamaForCausalLM" not in archs:
        raise HFError(f"{where}: model_type {config.get('model_type')!r} ({', '.join(archs) or 'no architectures'}); "
                      f"meshtrain reads Llama-architecture models (model_type llama)")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise HFError(f"{where}: {key} is true; meshtrain's Llama has no biases")
    if config.get("hidden_act", "silu") != "silu":
        raise HFError(f"{where}: hidden_act {config['hidden_act']!r}; meshtrain's Llama uses silu (SwiGLU)")
    try:
        d, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        kv = int(config.get("num_key_value_heads") or heads)
        spec = LlamaSpec(n_layers=int(config["num_hidden_layers"]), n_heads=heads, n_kv_heads=kv, d_model=d,
                         head_dim=int(config.get("head_dim") or d // heads),
                         ffn_dim=int(config["intermediate_size"]),
                         max_seq_len=int(config.get("max_position_embeddings", 2048)),
                         rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                         tie_embeddings=bool(config.get("tie_word_embeddings", False)), **_rope(config, where))
        vocab = int(config["vocab_size"])
    except KeyError as e:
        raise HFError(f"{where}: no {e.args[0]}") from None
    if heads % kv:
        raise HFError(f"{where}: num_key_value_heads {kv} does not divide num_attention_heads {heads}")
    return spec, vocab


def _rope(config: dict, where: str) -> dict:
    params = dict(config.get("rope_parameters") or {})
    if not params:  # the older spelling
        params = dict(config.get("rope_scaling") or {})
        params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise HFError(f"{where}: rope_type {kind!r}; meshtrain implements {', '.join(ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise HFError(f"{where}: partial_rotary_factor {params['partial_rotary_factor']}; meshtrain rotates whole heads")
    scaling = None
    if kind == "linear":
        scaling = RopeScaling("linear", float(params["factor"]))
    elif kind == "llama3":
        scaling = RopeScaling("llama3", float(params["factor"]), float(params["low_freq_factor"]),
                              float(params["high_freq_factor"]), int(params["original_max_position_embeddings"]))
    return {"rope_theta": float(params["rope_theta"]), "rope_scaling": scaling}


def config_from_spec(spec: LlamaSpec, vocab_size: int, dtype: str) -> dict:
    """A `config.json` the current transformers reads (and, for the rope, the older one too)."""
    rope = {"rope_type": "default", "rope_theta": spec.rope_theta}
    if spec.rope_scaling is not None:
        s = spec.rope_scaling
        rope = {"rope_type": s.kind, "rope_theta": spec.rope_theta, "factor": s.factor}
        if s.kind == "llama3":
            rope.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
                        original_max_position_embeddings=s.original_max_position_embeddings)
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": dtype, "torch_dtype": dtype,
            "vocab_size": vocab_size, "hidden_size": spec.d_model, "intermediate_size": spec.ffn_dim,
            "num_hidden_layers": spec.n_layers, "num_attention_heads": spec.n_heads,
            "num_key_value_heads": spec.kv_heads, "head_dim": spec.head_size, "hidden_act": "silu",
            "max_position_embeddings": spec.max_seq_len, "rms_norm_eps": spec.rms_norm_eps,
            "tie_word_embeddings": spec.tie_embeddings, "attention_bias": False, "mlp_bias": False,
            "rope_parameters": rope, "rope_theta": spec.rope_theta}


def hf_name(name: str) -> str:
    return name if name.startswith("lm_head.") else f"model.{name}"


def our_name(name: str) -> str:
    return name.removeprefix("model.")


def weight_files(folder: Path) -> list[Path]:
    """The folder's safetensors files: one, or those its index lists."""
    if (folder / WEIGHTS).is_file():
        return [folder / WEIGHTS]
    if (folder / INDEX).is_file():
        names = sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))
        return [folder / n for n in names]
    if (folder / "params.json").is_file() or list(folder.glob("consolidated.*.pth")):
        raise HFError(f"{folder}: Meta's original format (params.json, consolidated.*.pth); convert it with "
                      f"transformers' convert_llama_weights_to_hf.py first")
    raise HFError(f"{folder}: no {WEIGHTS} or {INDEX}")


def read_config(folder: Path) -> dict:
    folder = Path(folder)
    if not (folder / CONFIG).is_file():
        if (folder / "params.json").is_file():
            raise HFError(f"{folder}: Meta's original format (params.json, consolidated.*.pth); convert it with "
                          f"transformers' convert_llama_weights_to_hf.py first")
        raise HFError(f"{folder}: no {CONFIG}; give a Hugging Face model folder")
    return json.loads((folder / CONFIG).read_text())


class HFWeights:
    """A folder's weights for a model of its architecture: `init=` for `meshtrain.parallelize`
    (and the command line's --init-from), where each rank reads only its part of each
    parameter (`safe_open`'s `get_slice`), one tensor at a time, in fp32; and what `load_hf`
    fills a whole model from. Names and shapes are checked against the model first: a
    weight missing, one the model lacks (a tied head's copy aside) or of another shape is
    refused in one line."""

    def __init__(self, folder, model):
        from safetensors import safe_open
        self.folder = Path(folder)
        self._file: dict[str, Path] = {}
        wanted = {hf_name(n): tuple(p.shape) for n, p in model.named_parameters()}  # a tied head is one
        tied = model.lm_head.weight is model.embed_tokens.weight
        for path in weight_files(self.folder):
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    if key not in wanted:
                        if tied and key == "lm_head.weight":
                            continue
                        raise HFError(f"{path}: {key} is not a weight of this Llama (biases? another architecture?)")
                    shape = tuple(f.get_slice(key).get_shape())
                    if shape != wanted[key]:
                        raise HFError(f"{path}: {key} is {list(shape)}, but {CONFIG} makes it {list(wanted[key])}")
                    self._file[key] = path
        missing = sorted(set(wanted) - set(self._file))
        if missing:
            raise HFError(f"{self.folder}: {missing[0]} is missing ({len(missing)} weights in all)")

    def full_value(self, name: str):
        import torch
        from safetensors import safe_open
        key = hf_name(name)
        with safe_open(str(self._file[key]), framework="pt") as f:
            return f.get_tensor(key).to(torch.float32)

    def piece(self, name: str, index: tuple | None):
        """This rank's part of a parameter, `index` of its full tensor (None: all of it),
        reading only those bytes from the file where the index is slices (a fused layer's
        positions: the whole tensor, then indexed)."""
        import torch
        from safetensors import safe_open
        if index is None:
            return self.full_value(name)
        key = hf_name(name)
        with safe_open(str(self._file[key]), framework="pt") as f:
            if all(isinstance(i, slice) for i in index):
                return f.get_slice(key)[index].to(torch.float32)
            return f.get_tensor(key)[index].to(torch.float32)

    def fingerprint(self) -> int:
        """The same on every rank that reads the same files."""
        import hashlib
        text = repr(sorted((k, str(p.resolve()), p.stat().st_size) for k, p in self._file.items()))
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


def load_hf(folder, device="cpu", dtype=None):
    """The plain `Llama` of a Hugging Face folder, its weights in fp32 (or `dtype`)."""
    import torch

    from meshtrain.models.llama import Llama

    folder = Path(folder)
    spec, vocab = spec_from_config(read_config(folder), str(folder / CONFIG))
    with torch.device("meta"):
        model = Llama(spec, vocab)
    weights = HFWeights(folder, model)
    model.to_empty(device=device)
    if spec.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if dtype is not None:
        model.to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights.full_value(name))
    return model


def save_hf(model, folder, dtype=None) -> None:
    """Write `model` (a `Llama`) as a Hugging Face folder: `config.json` and safetensors,
    sharded at 2 GB with an index when larger; tied weights stored once, as HF does."""
    from meshtrain.checkpoint.export import write_shards

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {hf_name(n): p.detach().to("cpu", dtype=dtype or p.dtype).contiguous()
               for n, p in model.named_parameters()}  # a tied head once, under the embedding's name
    stored = next(iter(tensors.values())).dtype
    write_shards(folder, {n: t.numel() * t.element_size() for n, t in tensors.items()},
                 lambda names: {n: tensors[n] for n in names})
    config = config_from_spec(model.spec, model.vocab_size, str(stored).removeprefix("torch."))
    (folder / CONFIG).write_text(json.dumps(config, indent=2))

"""Hugging Face folders in and out for the Llama model: `load_hf(dir)` reads `config.json`
and `model.safetensors` (or a sharded index) into a plain `Llama`; `save_hf(model, dir)`
writes a folder `transformers.AutoModelForCausalLM.from_pretrained` loads as is. The module
names are HF's without `model.`, so both ways are a rename. What the model cannot represent
(biases, other RoPE types, another architecture, Meta's original format) is refused in one
line naming the key.

A folder written here is complete (`write_hf`): `config.json` with the special-token ids and
the rope in both spellings (`rope_parameters`, and `rope_scaling` with a top-level
`rope_theta` for transformers 4), `generation_config.json`, and the tokenizer with its
`tokenizer_config.json` — those of the folder the model was imported from (its `side_files`),
or written for meshtrain's own tokenizers (its BPE's `<|endoftext|>`; the byte tokenizer as a
byte-level `tokenizer.json` whose ids are the bytes)."""

from __future__ import annotations

import json
from pathlib import Path

from meshtrain.models.specs import LlamaSpec, RopeScaling

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
ROPE_TYPES = ("default", "llama3", "linear")
GENERATION_CONFIG = "generation_config.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
SIDE_FILES = (CONFIG, GENERATION_CONFIG, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP)  # small JSON beside the weights
SPECIALS = ("bos", "eos", "pad")
EOS_TEXT = "<|endoftext|>"  # meshtrain's own BPE's one special token (data.tokenizer)


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


def config_from_spec(spec: LlamaSpec, vocab_size: int, dtype: str, special_ids: dict | None = None) -> dict:
    """A `config.json` the current transformers reads, and for the rope the older one too
    (`rope_parameters`; `rope_scaling` without the theta, and `rope_theta`, which transformers
    5 also reads, the scaling first). `special_ids`: the bos/eos/pad ids (by "bos", "eos",
    "pad"; an eos may be a list), written null where unknown rather than left to
    LlamaConfig's defaults (1, 2)."""
    scaling = None
    if spec.rope_scaling is not None:
        s = spec.rope_scaling
        scaling = {"rope_type": s.kind, "type": s.kind, "factor": s.factor}
        if s.kind == "llama3":
            scaling.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
                           original_max_position_embeddings=s.original_max_position_embeddings)
    rope = {"rope_type": "default", "rope_theta": spec.rope_theta}
    if scaling is not None:
        rope = {k: v for k, v in scaling.items() if k != "type"} | {"rope_theta": spec.rope_theta}
    ids = special_ids or {}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": dtype, "torch_dtype": dtype,
            "vocab_size": vocab_size, "hidden_size": spec.d_model, "intermediate_size": spec.ffn_dim,
            "num_hidden_layers": spec.n_layers, "num_attention_heads": spec.n_heads,
            "num_key_value_heads": spec.kv_heads, "head_dim": spec.head_size, "hidden_act": "silu",
            "max_position_embeddings": spec.max_seq_len, "rms_norm_eps": spec.rms_norm_eps,
            "tie_word_embeddings": spec.tie_embeddings, "attention_bias": False, "mlp_bias": False,
            "rope_parameters": rope, "rope_scaling": scaling, "rope_theta": spec.rope_theta,
            **{f"{k}_token_id": ids.get(k) for k in SPECIALS}}


def side_files(folder) -> dict[str, dict]:
    """A Hugging Face folder's small JSON files (`SIDE_FILES`: its config, generation config
    and tokenizer configs) by name, those present: what an export of a model fine-tuned from
    it carries over, and what a checkpoint may keep of it (the folder may be gone by then)."""
    folder = Path(folder)
    out = {}
    for name in SIDE_FILES:
        if (folder / name).is_file():
            try:
                value = json.loads((folder / name).read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise HFError(f"{folder / name}: not valid JSON ({e}); fix or remove it") from None
            if isinstance(value, dict):
                out[name] = value
    return out


def _token_text(token) -> str | None:
    """A tokenizer_config's special token: a string or an added-token object."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def special_ids(side: dict[str, dict], tokenizer=None) -> dict:
    """The bos/eos/pad ids of a folder's `side_files`: config.json's `*_token_id` where it
    names them (an eos may be a list: Llama 3.1's instruct models), else tokenizer_config's
    tokens looked up in `tokenizer` (a `tokenizers.Tokenizer`). Without an imported folder,
    meshtrain's own BPE: `<|endoftext|>` ends documents and pads them (no BOS)."""
    config, tc = side.get(CONFIG, {}), side.get(TOKENIZER_CONFIG, {})
    ids = {}
    for k in SPECIALS:
        i = config.get(f"{k}_token_id")
        text = _token_text(tc.get(f"{k}_token"))
        if i is None and text is not None and tokenizer is not None:
            i = tokenizer.token_to_id(text)
        ids[k] = i
    if not side and tokenizer is not None and tokenizer.token_to_id(EOS_TEXT) is not None:
        ids["eos"] = ids["pad"] = tokenizer.token_to_id(EOS_TEXT)
    return ids


def byte_tokenizer():
    """meshtrain's byte tokenizer (ids are the UTF-8 bytes) as a `tokenizers.Tokenizer`: a
    byte-level BPE with no merges whose 256 tokens are GPT-2's printable stand-ins for the
    bytes, each at its byte's id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    char = {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(others)}
    tok = Tokenizer(models.BPE(vocab={char[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def write_side(folder, spec: LlamaSpec, vocab_size: int, dtype: str, side: dict[str, dict] | None = None,
               tokenizer: Path | None = None) -> list[str]:
    """Everything of a Hugging Face folder but the weights: the tokenizer (`tokenizer`, a
    tokenizer.json; the byte tokenizer's when the vocabulary is 256 bytes), config.json,
    generation_config.json, and tokenizer_config.json (with special_tokens_map.json when the
    imported folder has one). `side`: the imported folder's `side_files` (its generation and
    tokenizer configs are kept as they are, completed with the ids where they lack them).
    Returns the names written."""
    import shutil

    from tokenizers import Tokenizer

    from meshtrain.atomic import atomic_write
    folder, side = Path(folder), dict(side or {})
    written = []

    def put(name: str, value: dict) -> None:
        atomic_write(folder / name, lambda p: p.write_text(json.dumps(value, indent=2) + "\n"))
        written.append(name)

    tok = None
    if tokenizer is not None:
        atomic_write(folder / TOKENIZER, lambda p: shutil.copyfile(tokenizer, p))
        tok = Tokenizer.from_file(str(tokenizer))
    elif vocab_size == 256:
        tok = byte_tokenizer()
        atomic_write(folder / TOKENIZER, lambda p: tok.save(str(p)))
    if tok is not None:
        written.append(TOKENIZER)
    ids = special_ids(side, tok)
    put(CONFIG, config_from_spec(spec, vocab_size, dtype, ids))
    generation = dict(side.get(GENERATION_CONFIG) or {"_from_model_config": True})
    for k in SPECIALS:
        if ids[k] is not None:
            generation.setdefault(f"{k}_token_id", ids[k])
    put(GENERATION_CONFIG, generation)
    if tok is None:
        return written
    if TOKENIZER_CONFIG in side:
        put(TOKENIZER_CONFIG, side[TOKENIZER_CONFIG])
    else:
        def text(i):
            return tok.id_to_token(i[0] if isinstance(i, list) and i else i) if isinstance(i, (int, list)) else None
        put(TOKENIZER_CONFIG, {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": spec.max_seq_len,
                               "clean_up_tokenization_spaces": False,
                               **{f"{k}_token": text(ids[k]) for k in SPECIALS}})
    if SPECIAL_TOKENS_MAP in side:
        put(SPECIAL_TOKENS_MAP, side[SPECIAL_TOKENS_MAP])
    return written


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


def hf_weights(spec: LlamaSpec, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """The Hugging Face names and shapes of a Llama's weights (a tied head once, under the
    embedding's name, as HF stores it), from a model built on the meta device (no memory)."""
    import torch

    from meshtrain.models.llama import Llama
    with torch.device("meta"):
        model = Llama(spec, vocab_size)
    return {hf_name(n): tuple(p.shape) for n, p in model.named_parameters()}


def write_hf(folder, spec: LlamaSpec, vocab_size: int, read, dtype, *, side: dict[str, dict] | None = None,
             tokenizer: Path | None = None, max_shard_bytes: int | None = None, log=lambda msg: None) -> list[Path]:
    """A complete Hugging Face folder for a Llama of `spec`: its weights as safetensors in
    `dtype` (a torch dtype), asking `read(hf_name)` for one tensor at a time (so no more than
    one is held at once here), sharded at `max_shard_bytes` (2 GB) with an index; then
    `write_side`'s files. Returns the weight files."""
    from meshtrain.checkpoint.safetensors_files import MAX_SHARD_BYTES, write_shards

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shapes = {n: (shape, dtype) for n, shape in hf_weights(spec, vocab_size).items()}
    files = write_shards(folder, shapes, lambda name: read(name).to(dtype), log=log,
                         max_shard_bytes=max_shard_bytes or MAX_SHARD_BYTES)
    write_side(folder, spec, vocab_size, str(dtype).removeprefix("torch."), side, tokenizer)
    return files


def save_hf(model, folder, dtype=None, *, like=None, tokenizer=None) -> None:
    """Write `model` (a `Llama`) as a Hugging Face folder (`write_hf`): safetensors sharded at
    2 GB, tied weights stored once as HF does, config.json and generation_config.json.
    `like`: the Hugging Face folder the model came from, whose special tokens, tokenizer and
    configs go along; `tokenizer`: a tokenizer.json to put beside (default `like`'s)."""
    folder = Path(folder)
    params = dict(model.named_parameters())
    side = side_files(like) if like is not None else None
    if tokenizer is None and like is not None and (Path(like) / TOKENIZER).is_file():
        tokenizer = Path(like) / TOKENIZER
    write_hf(folder, model.spec, model.vocab_size, lambda name: params[our_name(name)].detach().to("cpu"),
             dtype or next(iter(params.values())).dtype, side=side, tokenizer=tokenizer)

"""Hugging Face folders in and out, for every model family whose recipe maps them
(`Family.hf_folders`: the Llama; the MoE as Mixtral, Qwen3-MoE or OLMoE): `load_hf(dir)`
reads `config.json` and `model.safetensors` (or a sharded index) into the family's plain
model; `save_hf(model, dir)` writes a folder `transformers.AutoModelForCausalLM.from_pretrained`
loads as is. What is generic lives here — the files, the tokenizer and its configs, reading
each rank's part of a weight, sharded writing; each family's recipe holds its `config.json`
keys and where each of its parameters lies on disk (`Family.hf_parts`: one key, or several
keys each holding a part, as transformers writes a stacked MoE's experts one per expert;
`recipes/llama.py`, `recipes/moe_hf.py`). What no family can represent (another
architecture, Meta's original format) is refused in one line naming the key.

A folder written here is complete (`write_hf`): `config.json` with the special-token ids and
the rope in both spellings (`rope_parameters`, and `rope_scaling` with a top-level
`rope_theta` for transformers 4), `generation_config.json`, and the tokenizer with its
`tokenizer_config.json` — those of the folder the model was imported from (its `side_files`),
or written for meshtrain's own tokenizers (its BPE's `<|endoftext|>`; the byte tokenizer as a
byte-level `tokenizer.json` whose ids are the bytes)."""

from __future__ import annotations

import json
from pathlib import Path

from meshtrain.checkpoint import weight_files as files
from meshtrain.recipes import FAMILIES, Family, family_of, family_of_model
from meshtrain.recipes.family import HFError
from meshtrain.atomic import atomic_write

CONFIG = "config.json"
WEIGHTS, INDEX = files.WEIGHTS, files.SHARD_INDEX
GENERATION_CONFIG = "generation_config.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
SIDE_FILES = (CONFIG, GENERATION_CONFIG, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP)  # small JSON beside the weights
SPECIALS = ("bos", "eos", "pad")
EOS_TEXT = "<|endoftext|>"  # meshtrain's own BPE's one special token (data.tokenizer)


def family_for(config: dict, where: str = CONFIG) -> Family:
    """The family whose recipe reads this `config.json`."""
    for family in FAMILIES.values():
        if family.hf_folders and family.hf_reads(config):
            return family
    archs = config.get("architectures") or []
    readable = ", ".join(t for f in FAMILIES.values() if f.hf_folders for t in f.hf_types)
    raise HFError(f"{where}: model_type {config.get('model_type')!r} ({', '.join(archs) or 'no architectures'}); "
                  f"meshtrain reads the model_types {readable}")


def spec_from_config(config: dict, where: str = CONFIG) -> tuple:
    """(spec, vocabulary size) of a Hugging Face `config.json`, by its family's recipe."""
    return family_for(config, where).spec_from_hf(config, where)


def config_from_spec(spec, vocab_size: int, dtype: str, special_ids: dict | None = None) -> dict:
    """The `config.json` of `spec`, by its family's recipe (special ids null where unknown)."""
    return family_of(spec).hf_config(spec, vocab_size, dtype, special_ids or {})


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


def model_pad(spec) -> dict:
    """{"pad": the spec's `pad_token_id`} where the model has one (the embedding row it trained
    without a gradient, read from the imported folder's config.json), so that the config.json
    written makes transformers' embedding the same; else {} (the special ids decide)."""
    pad = getattr(spec, "pad_token_id", None)
    return {} if pad is None else {"pad": pad}


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


def write_side(folder, spec, vocab_size: int, dtype: str, side: dict[str, dict] | None = None,
               tokenizer: Path | None = None) -> list[str]:
    """Everything of a Hugging Face folder but the weights: the tokenizer (`tokenizer`, a
    tokenizer.json; the byte tokenizer's when the vocabulary is 256 bytes), config.json,
    generation_config.json, and tokenizer_config.json (with special_tokens_map.json when the
    imported folder has one). `side`: the imported folder's `side_files` (its generation and
    tokenizer configs are kept as they are, completed with the ids where they lack them).
    Returns the names written."""
    import shutil

    from tokenizers import Tokenizer

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
    ids = special_ids(side, tok) | model_pad(spec)
    config = config_from_spec(spec, vocab_size, dtype, ids)
    put(CONFIG, config)
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
        put(TOKENIZER_CONFIG, {"tokenizer_class": "PreTrainedTokenizerFast",
                               "model_max_length": config.get("max_position_embeddings"),
                               "clean_up_tokenization_spaces": False,
                               **{f"{k}_token": text(ids[k]) for k in SPECIALS}})
    if SPECIAL_TOKENS_MAP in side:
        put(SPECIAL_TOKENS_MAP, side[SPECIAL_TOKENS_MAP])
    return written


def weight_files(folder: Path) -> list[Path]:
    """The folder's safetensors files: one, or those its index lists."""
    try:
        return files.weight_files(Path(folder))
    except files.WeightFilesError as e:
        raise HFError(str(e)) from None


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
    fills a whole model from. A parameter is one tensor on disk, or several its family's
    `hf_parts` names (a stacked MoE's experts, one key each), assembled as it is read.
    Names and shapes are checked against the model first: a weight missing, one the model
    lacks (a tied head's copy aside) or of another shape is refused in one line."""

    def __init__(self, folder, model):
        from safetensors import safe_open
        self.folder = Path(folder)
        self._file: dict[str, Path] = {}
        family = _family_of_model(model)
        self._parts = {n: family.hf_parts(model.spec, n) for n, _ in model.named_parameters()}  # a tied weight once
        self._shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        wanted = {key: _part_shape(self._shapes[n], index) for n, parts in self._parts.items() for key, index in parts}
        aliases = {key for n, _ in model.named_parameters(remove_duplicate=False) if n not in self._parts
                   for key, _ in family.hf_parts(model.spec, n)}
        what = type(model).__name__
        for path in weight_files(self.folder):
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    if key not in wanted:
                        if key in aliases:  # a tied weight's copy
                            continue
                        raise HFError(f"{path}: {key} is not a weight of this {what} (biases? another architecture?)")
                    shape = tuple(f.get_slice(key).get_shape())
                    if shape != wanted[key]:
                        raise HFError(f"{path}: {key} is {list(shape)}, but {CONFIG} makes it {list(wanted[key])}")
                    self._file[key] = path
        missing = [key for key in wanted if key not in self._file]
        if missing:
            raise HFError(f"{self.folder}: {min(missing)} is missing ({len(missing)} weights in all)")

    def full_value(self, name: str):
        import torch
        from safetensors import safe_open
        parts = self._parts[name]
        if len(parts) == 1 and parts[0][1] == ():
            with safe_open(str(self._file[parts[0][0]]), framework="pt") as f:
                return f.get_tensor(parts[0][0]).to(torch.float32)
        out = torch.empty(self._shapes[name], dtype=torch.float32)
        by_file: dict[Path, list] = {}
        for key, index in parts:
            by_file.setdefault(self._file[key], []).append((key, index))
        for path, keys in by_file.items():
            with safe_open(str(path), framework="pt") as f:
                for key, index in keys:
                    out[index] = f.get_tensor(key)
        return out

    def piece(self, name: str, index: tuple | None):
        """This rank's part of a parameter, `index` of its full tensor (None: all of it).
        Where the index is slices of a tensor stored under one key, only those bytes are
        read; otherwise (a fused layer's positions, a parameter stored in parts) the whole
        tensor, then indexed."""
        import torch
        from safetensors import safe_open
        (key, whole), *more = self._parts[name]
        if index is None or more or whole != ():
            full = self.full_value(name)
            return full if index is None else full[index]
        with safe_open(str(self._file[key]), framework="pt") as f:
            if all(isinstance(i, slice) for i in index):
                return f.get_slice(key)[index].to(torch.float32)
            return f.get_tensor(key)[index].to(torch.float32)

    def fingerprint(self) -> int:
        """The same on every rank that reads the same files."""
        import hashlib
        text = repr(sorted((k, str(p.resolve()), p.stat().st_size) for k, p in self._file.items()))
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


def _part_shape(shape: tuple[int, ...], index: tuple) -> tuple[int, ...]:
    """The shape of `tensor[index]` for a tensor of `shape` (`index`: ints and slices)."""
    out = list(shape[len(index):])
    for i, n in reversed(list(zip(index, shape))):
        if isinstance(i, slice):
            out.insert(0, len(range(*i.indices(n))))
    return tuple(out)


def _family_of_model(model) -> Family:
    family = family_of_model(model)
    if family is None or not family.hf_folders:
        raise HFError(f"{type(model).__name__}: no model family meshtrain knows writes it as a Hugging Face folder")
    return family


def _ties(model) -> list[list[str]]:
    """Groups of names that are one parameter (a tied head and its embedding)."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _retie(model, ties: list[list[str]]) -> None:
    for first, *others in ties:
        for name in others:
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, model.get_parameter(first))


def load_hf(folder, device="cpu", dtype=None):
    """The plain model of a Hugging Face folder (its family's), its weights in fp32 (or
    `dtype`), its running state (a router's load counts) at zero."""
    import torch

    from meshtrain.parallel.materialize import cast_keeping_state_fp32

    folder = Path(folder)
    config = read_config(folder)
    family = family_for(config, str(folder / CONFIG))
    spec, vocab = family.spec_from_hf(config, str(folder / CONFIG))
    with torch.device("meta"):
        model = family.build(spec, vocab_size=vocab)
    weights = HFWeights(folder, model)
    ties = _ties(model)
    model.to_empty(device=device)
    _retie(model, ties)
    if dtype is not None:
        cast_keeping_state_fp32(model, dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights.full_value(name))
        for b in model.buffers():
            b.zero_()
    return model


def _meta_model(spec, vocab_size: int):
    """A model of `spec` built on the meta device (no memory): its names and shapes."""
    import torch

    with torch.device("meta"):
        return family_of(spec).build(spec, vocab_size=vocab_size)


def hf_layout(spec, vocab_size: int) -> dict[str, tuple[str, tuple, tuple[int, ...]]]:
    """Each tensor of a Hugging Face folder of a model of `spec`, by its key, in the order
    written (a parameter's parts together): (our parameter, the part of it that key holds,
    an index (`()`: all of it), and its shape), as the family's `hf_parts` says; a tied head
    once, under the embedding's name, as HF stores it."""
    family = family_of(spec)
    return {key: (name, index, _part_shape(tuple(p.shape), index))
            for name, p in _meta_model(spec, vocab_size).named_parameters()
            for key, index in family.hf_parts(spec, name)}


def hf_weights(spec, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """The Hugging Face names and shapes of a model's weights (`hf_layout`'s)."""
    return {key: shape for key, (_, _, shape) in hf_layout(spec, vocab_size).items()}


def our_weights(spec, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Our names and full shapes of a model's weights (a tied head once, as the embedding)."""
    return {name: tuple(p.shape) for name, p in _meta_model(spec, vocab_size).named_parameters()}


def tied_copies(spec, vocab_size: int) -> set[str]:
    """The names (ours) that are a tied weight's second name (a tied head), which HF stores once."""
    return {n for names in _ties(_meta_model(spec, vocab_size)) for n in names[1:]}


def state_buffers(spec, vocab_size: int) -> set[str]:
    """The names (ours) of a model's saved buffers (running state, such as a router's bias):
    a checkpoint holds them, a Hugging Face folder does not (`Family.hf_state_problem`)."""
    model = _meta_model(spec, vocab_size)
    return set(model.state_dict()) - {n for n, _ in model.named_parameters(remove_duplicate=False)}


def write_hf(folder, spec, vocab_size: int, read, dtype, *, side: dict[str, dict] | None = None,
             tokenizer: Path | None = None, max_shard_bytes: int | None = None, log=lambda msg: None,
             before_writing=lambda: None) -> list[Path]:
    """A complete Hugging Face folder for a model of `spec`: its weights as safetensors in
    `dtype` (a torch dtype), asking `read(name)` for one of our parameters at a time, whole
    (so no more than one is held at once here; one stored in parts, a stacked MoE's experts,
    is read once and written key by key), sharded at `max_shard_bytes` (2 GB) with an index;
    then `write_side`'s files. A spec its family cannot write is refused (one line) before
    anything is, and `before_writing()` runs then (the command line clears its --out there).
    Returns the weight files."""
    from meshtrain.checkpoint.safetensors_files import MAX_SHARD_BYTES, write_shards  # torch: only a writer

    dtype_name = str(dtype).removeprefix("torch.")
    config_from_spec(spec, vocab_size, dtype_name)  # what cannot be written, said first
    folder = Path(folder)
    layout = hf_layout(spec, vocab_size)
    held: dict = {}

    def part(key: str):
        name, index, _ = layout[key]
        if name not in held:
            held.clear()  # the last parameter goes before the next is read
            held[name] = read(name).to(dtype)
        return held[name][index]

    before_writing()
    folder.mkdir(parents=True, exist_ok=True)
    shapes = {key: (shape, dtype) for key, (_, _, shape) in layout.items()}
    files = write_shards(folder, shapes, part, log=log, max_shard_bytes=max_shard_bytes or MAX_SHARD_BYTES)
    held.clear()
    write_side(folder, spec, vocab_size, dtype_name, side, tokenizer)
    return files


def save_hf(model, folder, dtype=None, *, like=None, tokenizer=None) -> None:
    """Write `model` (of a family with Hugging Face folders: a `Llama`, a `MoEModel`) as a
    Hugging Face folder (`write_hf`): safetensors sharded at 2 GB, tied weights stored once
    as HF does, config.json and generation_config.json. `like`: the Hugging Face folder the
    model came from, whose special tokens, tokenizer and configs go along; `tokenizer`: a
    tokenizer.json to put beside (default `like`'s). A buffer the format cannot hold (a
    router's nonzero bias) is refused in one line."""
    family = _family_of_model(model)
    folder = Path(folder)
    params = dict(model.named_parameters())
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    for name, value in model.state_dict().items():
        problem = None if name in names else family.hf_state_problem(model.spec, name, value)
        if problem:
            raise HFError(f"save_hf: {problem}; save it in meshtrain's own format instead")
    side = side_files(like) if like is not None else None
    if tokenizer is None and like is not None and (Path(like) / TOKENIZER).is_file():
        tokenizer = Path(like) / TOKENIZER
    write_hf(folder, model.spec, model.vocab_size, lambda name: params[name].detach().to("cpu"),
             dtype or next(iter(params.values())).dtype, side=side, tokenizer=tokenizer)

"""Tokenizers: a byte-level BPE trained locally with Hugging Face `tokenizers` (seconds on a
few MB of text), and a plain byte tokenizer (vocabulary 256) that needs nothing at all.

Both encode a list of documents into one token stream with each document's boundaries: the
BPE puts the BOS/EOS ids it is given around each document (meshtrain's own BPE has an
`<|endoftext|>` EOS, GPT-2 style; an imported one's come from its folder,
`imported_specials`); the byte tokenizer has no special token and joins documents by a blank
line, as the text was joined before documents existed."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshtrain.atomic import atomic_write
from meshtrain.data.corpus import DOCUMENT_SEPARATOR, DataError, read_documents

TOKENIZER_FILE = "tokenizer.json"
EOS_TEXT = "<|endoftext|>"  # meshtrain's own BPE: the token between documents
_LINES_PER_BATCH = 1 << 16  # lines per `encode_batch` call: bounds the Encoding objects alive at once


@dataclass(frozen=True)
class Specials:
    """The ids put around each document (None: none), and what --pad-documents pads with."""
    bos: int | None = None
    eos: int | None = None
    pad: int = 0


def pack(flat: np.ndarray, lengths: np.ndarray, bos: int | None, eos: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Documents' ids laid end to end (`flat`, `lengths` per document) with BOS before and
    EOS after each: (the stream, the n+1 boundaries of the documents in it)."""
    extra = (bos is not None) + (eos is not None)
    bounds = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(np.asarray(lengths, dtype=np.int64) + extra, out=bounds[1:])
    if not extra:
        return flat, bounds
    out = np.empty(int(bounds[-1]), dtype=flat.dtype)
    text = np.ones(len(out), dtype=bool)
    if bos is not None:
        out[bounds[:-1]], text[bounds[:-1]] = bos, False
    if eos is not None:
        out[bounds[1:] - 1], text[bounds[1:] - 1] = eos, False
    out[text] = flat
    return out, bounds


def token_dtype(vocab_size: int) -> np.dtype:
    """What a token file stores ids in: uint16 up to 65,536 ids, uint32 above (Llama 3's 128,256)."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


class ByteTokenizer:
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def encode_documents(self, docs: list[str], specials: Specials | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The documents joined by a blank line (no special token exists: every byte is text),
        and their boundaries (each document owns the separator after it)."""
        parts = [d.encode("utf-8") for d in docs]
        sep = DOCUMENT_SEPARATOR.encode()
        lengths = np.array([len(b) + len(sep) for b in parts], dtype=np.int64)
        if len(lengths):
            lengths[-1] -= len(sep)
        bounds = np.zeros(len(parts) + 1, dtype=np.int64)
        np.cumsum(lengths, out=bounds[1:])
        return np.frombuffer(sep.join(parts), dtype=np.uint8).astype(np.uint16), bounds


class BPETokenizer:
    def __init__(self, tokenizer):
        self._tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()

    @classmethod
    def train(cls, files: list[Path], vocab_size: int) -> "BPETokenizer":
        return cls.train_documents(read_documents(files), vocab_size)

    @classmethod
    def train_documents(cls, docs: list[str], vocab_size: int) -> "BPETokenizer":
        """A byte-level BPE of `vocab_size` tokens, `<|endoftext|>` (id 0) among them."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, special_tokens=[EOS_TEXT],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(docs, trainer, length=len(docs))
        return cls(tok)

    def own_specials(self) -> Specials:
        """meshtrain's own BPE: `<|endoftext|>` after each document (and as padding), no BOS."""
        eos = self.token_to_id(EOS_TEXT)
        return Specials(bos=None, eos=eos, pad=eos if eos is not None else 0)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @classmethod
    def load(cls, path: Path) -> "BPETokenizer":
        from tokenizers import Tokenizer
        return cls(Tokenizer.from_file(str(path)))

    def save(self, path: Path) -> None:
        atomic_write(path, lambda tmp: self._tok.save(str(tmp)))

    def encode(self, text: str) -> np.ndarray:
        return self._encode_lines(text.splitlines(keepends=True))[0]

    def encode_documents(self, docs: list[str], specials: Specials) -> tuple[np.ndarray, np.ndarray]:
        """Every document's ids with `specials`' BOS before and EOS after it: (the stream, the
        documents' n+1 boundaries in it)."""
        lines, n_lines = [], np.empty(len(docs), dtype=np.int64)
        for i, doc in enumerate(docs):
            mine = doc.splitlines(keepends=True)
            lines += mine
            n_lines[i] = len(mine)
        flat, per_line = self._encode_lines(lines)
        line_ends = np.zeros(len(lines) + 1, dtype=np.int64)
        np.cumsum(per_line, out=line_ends[1:])
        doc_ends = line_ends[np.cumsum(n_lines)]  # tokens up to each document's end
        return pack(flat, np.diff(doc_ends, prepend=0), specials.bos, specials.eos)

    def _encode_lines(self, lines: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(the lines' ids laid end to end, each line's token count). Line by line in batch
        calls: fast, and the byte-level BPE keeps the newlines. No special tokens per line (an
        imported tokenizer's post-processor would add a BOS to each)."""
        dtype, pieces, counts = token_dtype(self.vocab_size), [], []
        for at in range(0, len(lines), _LINES_PER_BATCH):
            encs = self._tok.encode_batch(lines[at:at + _LINES_PER_BATCH], add_special_tokens=False)
            n = np.fromiter((len(e.ids) for e in encs), dtype=np.int64, count=len(encs))
            pieces.append(np.fromiter(itertools.chain.from_iterable(e.ids for e in encs), dtype=dtype,
                                      count=int(n.sum())))
            counts.append(n)
        if not pieces:
            return np.zeros(0, dtype=dtype), np.zeros(0, dtype=np.int64)
        return np.concatenate(pieces), np.concatenate(counts)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not valid JSON ({e}); fix or remove it") from None
    return value if isinstance(value, dict) else {}


def imported_specials(folder: Path, tokenizer: BPETokenizer, vocab_size: int) -> Specials:
    """An imported Hugging Face folder's document boundaries, as its tokenizer defines them:
    `tokenizer_config.json`'s `bos_token`/`eos_token`/`pad_token` (a string or an added-token
    object), falling back to `config.json`'s `bos_token_id`/`eos_token_id`/`pad_token_id`
    (the first of a list); BOS and EOS are put around each document where
    `add_bos_token`/`add_eos_token` say so, and where those are absent whenever they are
    defined. The pad id is the pad token, else EOS, else 0."""
    config_file = folder / "tokenizer_config.json"
    tc, cfg = _read_json(config_file), _read_json(folder / "config.json")

    def special(name: str) -> int | None:
        token = tc.get(f"{name}_token")
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str):
            i = tokenizer.token_to_id(token)
            if i is None:
                raise DataError(f"{config_file}: {name}_token {token!r} is not a token of tokenizer.json")
        else:
            i = cfg.get(f"{name}_token_id")
            i = i[0] if isinstance(i, list) and i else i
            if not isinstance(i, int) or isinstance(i, bool):
                return None
        if not 0 <= i < vocab_size:
            raise DataError(f"{folder}: the {name} token's id {i} is outside the model's {vocab_size:,} embedding rows")
        return i

    bos, eos, pad = special("bos"), special("eos"), special("pad")
    return Specials(bos=bos if tc.get("add_bos_token", True) else None,
                    eos=eos if tc.get("add_eos_token", True) else None,
                    pad=pad if pad is not None else eos if eos is not None else 0)


def load_tokenizer(folder: Path, vocab_size: int):
    """The tokenizer cached in `folder` (next to the token file), or the byte tokenizer."""
    if vocab_size == ByteTokenizer.vocab_size:
        return ByteTokenizer()
    return BPETokenizer.load(folder / TOKENIZER_FILE)

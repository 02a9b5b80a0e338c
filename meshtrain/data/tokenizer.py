"""Tokenizers: a byte-level BPE trained locally with Hugging Face `tokenizers` (seconds on a
few MB of text), an imported `tokenizer.json` used as it is, and a plain byte tokenizer
(vocabulary 256) that needs nothing at all.

Both encode a list of documents into one token stream with each document's boundaries. A
`tokenizer.json` encodes each WHOLE document as `tokenizers` does,
`encode(document, add_special_tokens=True)`: its own post-processor puts whatever it puts
around a sequence (Llama 3's a BOS before it; meshtrain's own BPE has none), and then the
document separator follows, the EOS id (`Specials.eos`: meshtrain's own BPE's
`<|endoftext|>`, GPT-2 style; an imported folder's from its files, `imported_specials`),
unless the post-processor already ended the document with it. A document longer than
`BPETokenizer.piece_chars` is encoded in pieces cut only where the pre-tokenizer splits the
text anyway (each cut checked on the text around it), so memory stays bounded and the ids
are the whole document's. The byte tokenizer has no special token and joins documents by a
blank line, as the text was joined before documents existed. docs/data.md has the rules."""

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
# One `encode_batch` call takes at most this many texts and characters: bounds the Encoding
# objects alive at once (about 450 bytes a token: ~400 MB for 2^21 characters of English).
_TEXTS_PER_BATCH, _CHARS_PER_BATCH = 1 << 16, 1 << 21
_CUT_WINDOW = 1024  # characters on each side of a cut, tokenized with and without it


@dataclass(frozen=True)
class Specials:
    """`bos`: the id the tokenizer's post-processor puts first in each document (None: none;
    recorded in meta.json); `eos`: the document separator (None: none), after each document
    unless the post-processor put it there; `pad`: what --pad-documents pads with."""
    bos: int | None = None
    eos: int | None = None
    pad: int = 0


def pack(flat: np.ndarray, lengths: np.ndarray, before: tuple[int, ...] = (),
         after: tuple[int, ...] = ()) -> tuple[np.ndarray, np.ndarray]:
    """Documents' ids laid end to end (`flat`, `lengths` per document) with the ids `before`
    ahead of each and `after` behind each: (the stream, the n+1 boundaries of the documents
    in it)."""
    extra = len(before) + len(after)
    bounds = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(np.asarray(lengths, dtype=np.int64) + extra, out=bounds[1:])
    if not extra:
        return flat, bounds
    out = np.empty(int(bounds[-1]), dtype=flat.dtype)
    text = np.ones(len(out), dtype=bool)
    for k, i in enumerate(before):
        out[bounds[:-1] + k], text[bounds[:-1] + k] = i, False
    for k, i in enumerate(after):
        at = bounds[1:] - len(after) + k
        out[at], text[at] = i, False
    out[text] = flat
    return out, bounds


def token_dtype(vocab_size: int) -> np.dtype:
    """What a token file stores ids in: uint16 up to 65,536 ids, uint32 above (Llama 3's 128,256)."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


class ByteTokenizer:
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def encode_prompt(self, text: str) -> list[int]:
        return self.encode(text).tolist()  # no special tokens: every byte is text

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def encode_documents(self, docs: list[str], specials: Specials | None = None,
                         last: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """The documents joined by a blank line (no special token exists: every byte is text),
        and their boundaries (each document owns the separator after it; the `last` batch's
        last document has none)."""
        parts = [d.encode("utf-8") for d in docs]
        sep = DOCUMENT_SEPARATOR.encode()
        lengths = np.array([len(b) + len(sep) for b in parts], dtype=np.int64)
        if len(lengths) and last:
            lengths[-1] -= len(sep)
        elif len(lengths):
            parts.append(b"")  # the separator after the last document: more follow
        bounds = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=bounds[1:])
        return np.frombuffer(sep.join(parts), dtype=np.uint8).astype(np.uint16), bounds


class BPETokenizer:
    """A `tokenizers.Tokenizer` (meshtrain's own BPE, or an imported tokenizer.json)."""
    piece_chars = 1 << 18  # a longer document is encoded in pieces of at most about this many characters

    def __init__(self, tokenizer):
        # A tokenizer.json may carry truncation or padding meant for a model's inputs: a
        # document is never cut short or padded.
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self._tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        self.before, self.after = _added_around(tokenizer)

    @classmethod
    def train(cls, files: list[Path], vocab_size: int) -> "BPETokenizer":
        return cls.train_documents(read_documents(files), vocab_size)

    @classmethod
    def train_documents(cls, docs, vocab_size: int) -> "BPETokenizer":
        """A byte-level BPE of `vocab_size` tokens, `<|endoftext|>` (id 0) among them, trained
        on the documents (a list, or any iterable: read once)."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, special_tokens=[EOS_TEXT],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(docs, trainer, length=len(docs) if hasattr(docs, "__len__") else None)
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
        """The text's ids, whole, without the post-processor's special tokens."""
        return self._encode_texts(self.pieces(text))[0]

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt's ids as transformers' `tokenizer(prompt)` gives them: with the
        post-processor's special tokens (Llama 3's BOS), as the model saw documents begin."""
        return self._tok.encode(text, add_special_tokens=True).ids

    def encode_documents(self, docs: list[str], specials: Specials, last: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Every document's ids as `tokenizers` encodes the whole document with its special
        tokens (`encode(doc, add_special_tokens=True)`), then the separator `specials.eos`
        unless the post-processor already ended the document with it: (the stream, the
        documents' n+1 boundaries in it)."""
        pieces, n_pieces = [], np.empty(len(docs), dtype=np.int64)
        for i, doc in enumerate(docs):
            mine = self.pieces(doc)
            pieces += mine
            n_pieces[i] = len(mine)
        flat, per_piece = self._encode_texts(pieces)
        piece_ends = np.zeros(len(pieces) + 1, dtype=np.int64)
        np.cumsum(per_piece, out=piece_ends[1:])
        doc_ends = piece_ends[np.cumsum(n_pieces)]  # tokens up to each document's end
        separator = (specials.eos,) if specials.eos is not None and self.after[-1:] != (specials.eos,) else ()
        around = self.before + self.after + separator
        flat = flat.astype(token_dtype(max((self.vocab_size, *(i + 1 for i in around)))), copy=False)
        return pack(flat, np.diff(doc_ends, prepend=0), self.before, self.after + separator)

    def pieces(self, text: str) -> list[str]:
        """`text` cut into pieces of at most about `piece_chars` characters, each cut where
        the pre-tokenizer starts a piece anyway and where the ids of the 2·1024 characters
        around it are the same tokenized whole or in two halves: the pieces' ids laid end to
        end are the text's. Where no such place is found (no pre-tokenizer, or one piece
        longer than the search), the rest of the text stays whole."""
        if len(text) <= self.piece_chars or self._tok.pre_tokenizer is None:
            return [text]
        pieces, at = [], 0
        while len(text) - at > self.piece_chars:
            cut = self._cut(text, at, at + self.piece_chars)
            if cut is None:
                break
            pieces.append(text[at:cut])
            at = cut
        return pieces + [text[at:]]

    def _cut(self, text: str, lo: int, hi: int, tries: int = 8) -> int | None:
        """A place in (lo, hi], at most 1024 characters before hi, where the pre-tokenizer
        starts a piece and the 1024 characters (at most) on each side of it tokenize the same
        whole and cut there: the nearest to hi of the `tries` starts nearest to it; None if none."""
        window = max(1, min(_CUT_WINDOW, (hi - lo) // 4))
        a = max(lo, hi - 2 * window)
        around = text[a:hi + window]
        whole = self._tok.encode(around, add_special_tokens=False).ids
        starts = sorted({s for _, (s, _) in self._tok.pre_tokenizer.pre_tokenize_str(around)
                         if lo < a + s <= hi and s >= hi - window - a}, reverse=True)
        for s in starts[:tries]:
            left = self._tok.encode(around[:s], add_special_tokens=False).ids
            right = self._tok.encode(around[s:], add_special_tokens=False).ids
            if left + right == whole:
                return a + s
        return None

    def _encode_texts(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(the texts' ids laid end to end, each text's token count), without special tokens,
        in `encode_batch` calls of a bounded size."""
        dtype, pieces, counts, at = token_dtype(self.vocab_size), [], [], 0
        while at < len(texts):
            end, chars = at, 0
            while end < len(texts) and end - at < _TEXTS_PER_BATCH and (
                    end == at or chars + len(texts[end]) <= _CHARS_PER_BATCH):
                chars += len(texts[end])
                end += 1
            encs = self._tok.encode_batch(texts[at:end], add_special_tokens=False)
            n = np.fromiter((len(e.ids) for e in encs), dtype=np.int64, count=len(encs))
            pieces.append(np.fromiter(itertools.chain.from_iterable(e.ids for e in encs), dtype=dtype,
                                      count=int(n.sum())))
            counts.append(n)
            at = end
        if not pieces:
            return np.zeros(0, dtype=dtype), np.zeros(0, dtype=np.int64)
        return np.concatenate(pieces), np.concatenate(counts)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def _added_around(tok) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids a tokenizer's post-processor puts before and after one sequence (Llama 3's:
    (BOS,) and ()), read off a probe text it post-processes: a template's special tokens do not
    depend on the text."""
    if tok.post_processor is None:
        return (), ()
    for probe in ("a", "0", ".", "the", " "):
        plain = tok.encode(probe, add_special_tokens=False)
        if plain.ids:
            break
    full = tok.post_process(plain)
    first = next((k for k, special in enumerate(full.special_tokens_mask) if not special), len(full.ids))
    if full.ids[first:first + len(plain.ids)] != plain.ids:
        raise DataError("tokenizer.json: its post-processor changes the text's own ids; meshtrain applies one that "
                        "adds special tokens around them (a template) only")
    return tuple(full.ids[:first]), tuple(full.ids[first + len(plain.ids):])


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not valid JSON ({e}); fix or remove it") from None
    return value if isinstance(value, dict) else {}


def imported_specials(folder: Path, tokenizer: BPETokenizer, vocab_size: int) -> Specials:
    """An imported Hugging Face folder's document separator and padding: the EOS is
    `tokenizer_config.json`'s `eos_token` (a string or an added-token object), else
    `config.json`'s `eos_token_id` (the first of a list); the pad id is `pad_token` /
    `pad_token_id` likewise, else EOS, else 0. What goes before (and after) a document is the
    tokenizer's own post-processor's, as `tokenizers` encodes (`Specials.bos`: its first id);
    tokenizer_config.json's `add_bos_token`/`add_eos_token` are not read."""
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

    eos, pad = special("eos"), special("pad")
    return Specials(bos=tokenizer.before[0] if tokenizer.before else None, eos=eos,
                    pad=pad if pad is not None else eos if eos is not None else 0)


def load_tokenizer(folder: Path, vocab_size: int):
    """The tokenizer cached in `folder` (next to the token file), or the byte tokenizer."""
    if vocab_size == ByteTokenizer.vocab_size:
        return ByteTokenizer()
    return BPETokenizer.load(folder / TOKENIZER_FILE)

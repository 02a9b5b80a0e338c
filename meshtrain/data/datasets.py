"""Datasets whose global batch of step k is a pure function of (seed, k): every layout sees
exactly the same samples, and each data-parallel rank takes its contiguous slice of rows.

Text is cached once as a token stream of documents (each with the tokenizer's BOS before
and EOS after it) and their boundaries; `TextData` draws random windows across documents
(packing), or with `pad_documents` rows that start at a document's start, padded, whose
padding targets are IGNORE_INDEX."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

from meshtrain.atomic import atomic_write
from meshtrain.data.corpus import DataError, read_documents, text_files
from meshtrain.data.tokenizer import (TOKENIZER_FILE, BPETokenizer, ByteTokenizer, Specials, imported_specials,
                                      load_tokenizer, token_dtype)
from meshtrain.loss import IGNORE_INDEX

TOKENS_FILE = "tokens.bin"
DOCUMENTS_FILE = "documents.bin"  # int64: the n+1 boundaries of the documents in tokens.bin
META_FILE = "meta.json"
LOCK_FILE = ".lock"
CACHE_VERSION = 2  # 2: documents with BOS/EOS, documents.bin (1's caches are one stream of text)


VAL_FRACTION = 0.01  # the held-out tail: never sampled for training


def _batch_rng(seed: int, step: int) -> np.random.Generator:
    return np.random.default_rng([seed, step])


def _val_rng(seed: int, k: int) -> np.random.Generator:
    """Validation batch k's draws: a stream apart from every training step's."""
    return np.random.default_rng([seed, k, 1])


def held_out(n: int, fraction: float = VAL_FRACTION) -> int:
    """Where the held-out tail of n items begins."""
    return n - max(1, int(n * fraction))


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "meshtrain"


def check_length(n_tokens: int, seq_len: int) -> None:
    if n_tokens < seq_len + 2:
        raise DataError(f"the text has {n_tokens} tokens, too few for --seq-len {seq_len}; "
                        f"use more text or a smaller --seq-len")


class TextData:
    """Random windows of a memory-mapped token file (uint16, or uint32 for a vocabulary above
    65,536, as its meta.json says): training windows from the first
    99% of the tokens, validation windows from the last 1% (never seen in training).

    `pad_documents`: instead, each row is one of the rows the documents are cut into — a
    document's first seq_len+1 tokens, then every seq_len further (consecutive rows overlap
    by one token, so each target is in one row), the last one padded with the pad id, its
    padding targets IGNORE_INDEX; rows are drawn at random. A document across the held-out
    boundary is cut there: its tail's rows start at the boundary."""

    def __init__(self, folder: Path, seq_len: int, seed: int, pad_documents: bool = False):
        meta = json.loads((folder / META_FILE).read_text())
        self.tokenizer = load_tokenizer(folder, meta["vocab_size"])
        self.tokens = np.memmap(folder / TOKENS_FILE, dtype=np.dtype(meta.get("dtype", "uint16")), mode="r")
        self.folder, self.vocab_size, self.seq_len, self.seed = folder, meta["vocab_size"], seq_len, seed
        self.bos_id, self.eos_id, self.pad_id = meta.get("bos_id"), meta.get("eos_id"), meta.get("pad_id") or 0
        self.split = held_out(len(self.tokens))
        check_length(self.split, seq_len)
        self.pad_documents = pad_documents
        if pad_documents:
            if not (folder / DOCUMENTS_FILE).is_file():
                raise DataError(f"{folder} has no {DOCUMENTS_FILE}; delete the folder to rebuild it")
            bounds = np.fromfile(folder / DOCUMENTS_FILE, dtype=np.int64)
            self.doc_rows = (_document_rows(bounds, 0, self.split, seq_len),
                             _document_rows(bounds, self.split, len(self.tokens), seq_len))
            if not len(self.doc_rows[0][0]):
                raise DataError(f"{folder}: no document has a token to predict; use longer documents")

    def batch(self, step: int, batch_size: int, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows `rows` of the global batch of `step`: (inputs, next-token targets)."""
        if self.pad_documents:
            return self._padded(_batch_rng(self.seed, step), self.doc_rows[0], batch_size, rows)
        return self._windows(_batch_rng(self.seed, step), 0, self.split, batch_size, rows)

    def val_batch(self, k: int, batch_size: int, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows `rows` of validation batch k, from the held-out tail."""
        if self.pad_documents:
            if not len(self.doc_rows[1][0]):
                raise DataError(f"the held-out {VAL_FRACTION:.0%} of the text has no token to predict; use more text")
            return self._padded(_val_rng(self.seed, k), self.doc_rows[1], batch_size, rows)
        if len(self.tokens) - self.split < self.seq_len + 1:
            raise DataError(f"the held-out {VAL_FRACTION:.0%} of the text has {len(self.tokens) - self.split} tokens, "
                            f"too few for --seq-len {self.seq_len}; use more text or a smaller --seq-len")
        return self._windows(_val_rng(self.seed, k), self.split, len(self.tokens), batch_size, rows)

    def _windows(self, rng, lo: int, hi: int, batch_size: int, rows: slice):
        starts = rng.integers(lo, hi - self.seq_len - 1, size=batch_size, endpoint=True)
        windows = np.stack([self.tokens[s:s + self.seq_len + 1] for s in starts[rows]]).astype(np.int64)
        w = torch.from_numpy(windows)
        return w[:, :-1], w[:, 1:]

    def _padded(self, rng, table: tuple[np.ndarray, np.ndarray], batch_size: int, rows: slice):
        starts, ends = table
        picks = rng.integers(0, len(starts), size=batch_size)[rows]
        width = self.seq_len + 1
        out = np.full((len(picks), width), self.pad_id, dtype=np.int64)
        lengths = np.minimum(ends[picks] - starts[picks], width)
        for r, (s, n) in enumerate(zip(starts[picks], lengths)):
            out[r, :n] = self.tokens[s:s + n]
        w = torch.from_numpy(out)
        targets = w[:, 1:].clone()
        targets[torch.arange(self.seq_len) >= torch.from_numpy(lengths - 1).unsqueeze(1)] = IGNORE_INDEX
        return w[:, :-1], targets

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids)

    def encode(self, text: str) -> np.ndarray:
        return self.tokenizer.encode(text)


class DigitsData:
    """scikit-learn's bundled 8x8 digits (1797 images), pixels scaled to [0, 1]."""
    n_inputs, n_classes = 64, 10

    def __init__(self, seed: int):
        from sklearn.datasets import load_digits
        d = load_digits()
        self.x = torch.tensor(d.data, dtype=torch.float32) / 16.0
        self.y = torch.tensor(d.target, dtype=torch.int64)
        self.seed = seed
        self.split = held_out(len(self.y))  # the last 1% (17 images) held out

    def batch(self, step: int, batch_size: int, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        idx = _batch_rng(self.seed, step).integers(0, self.split, size=batch_size)[rows]
        return self.x[idx], self.y[idx]

    def val_batch(self, k: int, batch_size: int, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        idx = _val_rng(self.seed, k).integers(self.split, len(self.y), size=batch_size)[rows]
        return self.x[idx], self.y[idx]


def _document_rows(bounds: np.ndarray, lo: int, hi: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(start, end of its document) of every row --pad-documents cuts the documents within
    tokens [lo, hi) into: a document's first row at its start, then every seq_len tokens
    while a target is left; a piece of one token has nothing to predict and gives none."""
    cuts = np.unique(np.concatenate([[lo, hi], np.clip(bounds, lo, hi)]))
    a, e = cuts[:-1], cuts[1:]
    n = -(-(e - a - 1) // seq_len)  # ceil((length - 1) / seq_len): 0 for a piece of 0 or 1 token
    first = np.repeat(np.cumsum(n) - n, n)
    starts = np.repeat(a, n) + (np.arange(int(n.sum())) - first) * seq_len
    return starts, np.repeat(e, n)


def _usable_vocab(vocab_size: int) -> int:
    """The byte tokenizer is the fallback when `tokenizers` is missing."""
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        if vocab_size != ByteTokenizer.vocab_size:
            print("meshtrain: `tokenizers` is not installed; using the byte tokenizer (vocab 256)", file=sys.stderr)
        return ByteTokenizer.vocab_size
    return vocab_size


def _text_cache_folder(source: str, vocab_size: int, tokenizer: Path | None = None) -> tuple[Path, list[Path]]:
    files = text_files(source)
    imported = []
    if tokenizer is not None:  # the tokenizer, and the files beside it that name its special tokens
        imported = [hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
                    for p in (tokenizer, tokenizer.with_name("tokenizer_config.json"), tokenizer.with_name("config.json"))]
    key = hashlib.sha256(json.dumps([[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
                                    + [vocab_size, CACHE_VERSION] + imported).encode()).hexdigest()[:16]
    name = "shakespeare" if source == "shakespeare" else Path(source).name or "data"
    return cache_root() / f"{name}-v{vocab_size}{'-imported' if imported else ''}-{key}", files


def _to_stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


def prepare_text(source: str, vocab_size: int, log=_to_stderr, tokenizer: Path | None = None) -> Path:
    """Tokenize the text once into a cached folder (tokenizer.json, tokens.bin, documents.bin,
    meta.json). Every file is written atomically: a reader never sees half. Returns the folder.
    `tokenizer`: an imported model's tokenizer.json, used as it is (`vocab_size`: that
    model's embedding rows); else a BPE of `vocab_size` is trained on the text."""
    if tokenizer is None:
        vocab_size = _usable_vocab(vocab_size)
    folder, files = _text_cache_folder(source, vocab_size, tokenizer)
    if (folder / META_FILE).exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    # Ranks under a launcher all get here: one builds the cache, the others wait on the lock
    # (no collective, so no timeout however long the text takes), then find it built.
    with open(folder / LOCK_FILE, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / META_FILE).exists():
            _build_text_cache(folder, files, source, vocab_size, log, tokenizer)
    return folder


def _build_text_cache(folder: Path, files: list[Path], source: str, vocab_size: int, log,
                      imported: Path | None = None) -> None:
    docs = read_documents(files)
    if imported is not None:
        tokenizer = BPETokenizer.load(imported)
        if tokenizer.vocab_size > vocab_size:
            raise DataError(f"{imported}: the tokenizer has {tokenizer.vocab_size:,} tokens, more than the model's "
                            f"{vocab_size:,} embedding rows")
        specials = imported_specials(imported.parent, tokenizer, vocab_size)
        tokenizer.save(folder / TOKENIZER_FILE)
    elif vocab_size == ByteTokenizer.vocab_size:
        tokenizer, specials = ByteTokenizer(), Specials()
    else:
        log(f"training a {vocab_size}-token BPE tokenizer on {sum(map(len, docs)) / 1e6:.1f} MB of text ...")
        tokenizer = BPETokenizer.train_documents(docs, vocab_size)
        specials = tokenizer.own_specials()
        tokenizer.save(folder / TOKENIZER_FILE)
    vocab = vocab_size if imported is not None else tokenizer.vocab_size  # the model's rows, or the BPE's
    ids, bounds = tokenizer.encode_documents(docs, specials)
    ids = ids.astype(token_dtype(vocab), copy=False)
    atomic_write(folder / TOKENS_FILE, ids.tofile)
    atomic_write(folder / DOCUMENTS_FILE, bounds.astype(np.int64, copy=False).tofile)
    meta = {"source": source, "files": len(files), "documents": len(docs), "n_tokens": int(len(ids)),
            "vocab_size": vocab, "dtype": str(ids.dtype), "bos_id": specials.bos, "eos_id": specials.eos,
            "pad_id": specials.pad}
    atomic_write(folder / META_FILE, lambda p: p.write_text(json.dumps(meta)))
    log(f"tokenized {len(files)} file(s) into {len(ids):,} tokens (cached in {folder})")


def prepare(data: str, model: str, vocab_size: int, seq_len: int, log=_to_stderr,
            tokenizer: Path | None = None) -> Path | None:
    """Build what the ranks will read (once, before they start); None when nothing is needed."""
    if model == "mlp":
        return None
    folder = prepare_text(data, vocab_size, log, tokenizer)
    check_length(json.loads((folder / META_FILE).read_text())["n_tokens"], seq_len)
    return folder


def open_dataset(data: str, model: str, vocab_size: int, seq_len: int, seed: int, tokenizer: Path | None = None,
                 pad_documents: bool = False):
    if model == "mlp":
        return DigitsData(seed)
    folder = prepare_text(data, vocab_size, tokenizer=tokenizer)  # cached: returns at once
    return TextData(folder, seq_len, seed, pad_documents=pad_documents)

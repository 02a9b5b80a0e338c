"""Datasets whose global batch of step k is a pure function of (seed, k): every layout sees
exactly the same samples, and each data-parallel rank takes its contiguous slice of rows.

Text is tokenized once into a prepared token folder (`prepared.py`'s format: the documents'
ids, each document as its tokenizer encodes it whole, with its separator, and their
boundaries): `meshtrain prepare` writes one where the user says, `train --data TEXT` into a
private cache. `TextData` reads one and draws random windows across documents (packing), or
with `pad_documents` rows that start at a document's start, padded, whose padding targets
are IGNORE_INDEX."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

from meshtrain.data import prepared
from meshtrain.data.build import (build_folder, imported_tokenizer_and_rows, prepare_folder,  # noqa: F401 (moved)
                                  usable_vocab)
from meshtrain.data.corpus import DataError, text_files
from meshtrain.data.prepared import DOCUMENTS_FILE, META_FILE, TOKENS_FILE  # noqa: F401 (the format's names)
from meshtrain.data.tokenizer import TOKENIZER_FILE, BPETokenizer, ByteTokenizer, imported_specials
from meshtrain.loss import IGNORE_INDEX

LOCK_FILE = ".lock"
# 3: the prepared format, each document tokenized whole (2: documents tokenized line by line; 1: one stream)
CACHE_VERSION = 3


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
    """Random windows of a prepared token folder's ids (memory-mapped: uint16, or uint32 for a
    vocabulary above 65,536, as its meta.json says): training windows from the first
    99% of the tokens, validation windows from the last 1% (never seen in training).

    `pad_documents`: instead, each row is one of the rows the documents are cut into — a
    document's first seq_len+1 tokens, then every seq_len further (consecutive rows overlap
    by one token, so each target is in one row), the last one padded with the pad id, its
    padding targets IGNORE_INDEX; rows are drawn at random. A document across the held-out
    boundary is cut there: its tail's rows start at the boundary."""

    def __init__(self, folder: Path, seq_len: int, seed: int, pad_documents: bool = False):
        meta = prepared.read_meta(folder)
        self.tokenizer = (ByteTokenizer() if meta["tokenizer"]["kind"] == prepared.BYTES
                          else BPETokenizer.load(folder / TOKENIZER_FILE))
        self.tokens = prepared.Tokens(folder, meta)
        self.folder, self.vocab_size, self.seq_len, self.seed = folder, meta["vocab_size"], seq_len, seed
        self.bos_id, self.eos_id, self.pad_id = meta.get("bos_id"), meta.get("eos_id"), meta.get("pad_id") or 0
        self.split = held_out(len(self.tokens))
        check_length(self.split, seq_len)
        self.pad_documents = pad_documents
        if pad_documents:
            bounds = prepared.document_bounds(folder, meta)
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
    """Tokenize the text once into a cached prepared folder (`build_folder`); meta.json is
    written last, so a reader never takes a half-built folder for one. Returns the folder.
    `tokenizer`: an imported model's tokenizer.json, used as it is (`vocab_size`: that
    model's embedding rows); else a BPE of `vocab_size` is trained on the text."""
    if tokenizer is None:
        vocab_size = usable_vocab(vocab_size)
    folder, files = _text_cache_folder(source, vocab_size, tokenizer)
    if (folder / META_FILE).exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    # Ranks under a launcher all get here: one builds the cache, the others wait on the lock
    # (no collective, so no timeout however long the text takes), then find it built.
    with open(folder / LOCK_FILE, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / META_FILE).exists():
            meta = build_folder(folder, files, source, vocab_size, log, tokenizer)
            log(f"tokenized {len(files)} file(s) into {meta['n_tokens']:,} tokens (cached in {folder})")
    return folder


def check_prepared(folder: Path, vocab_size: int, tokenizer: Path | None = None) -> dict:
    """A prepared folder given as --data, checked before the ranks start: this format's version,
    ids the model's `vocab_size` rows hold, and with --init-from (`tokenizer`) that folder's
    tokenizer and document separator. Returns its meta.json."""
    meta = prepared.read_meta(folder)
    if tokenizer is not None:
        prepared.check_tokenizer(folder, meta, tokenizer)
        eos = imported_specials(tokenizer.parent, BPETokenizer.load(tokenizer), vocab_size).eos
        if meta.get("eos_id") != eos:
            raise DataError(f"--data {folder} was prepared with end-of-document id {meta.get('eos_id')}, but "
                            f"--init-from {tokenizer.parent} says {eos}; prepare it again with --init-from "
                            f"{tokenizer.parent}")
    if meta["vocab_size"] > vocab_size:
        raise DataError(f"--data {folder} holds ids of a {meta['vocab_size']:,}-token vocabulary, more than the "
                        f"model's {vocab_size:,} embedding rows")
    return meta


def prepare(data: str, model: str, vocab_size: int, seq_len: int, log=_to_stderr,
            tokenizer: Path | None = None) -> Path | None:
    """Build what the ranks will read (once, before they start), or check the prepared folder
    --data names; None when nothing is needed."""
    if model == "mlp":
        return None
    folder = _prepared(data)
    if folder is not None:
        meta = check_prepared(folder, vocab_size, tokenizer)
    else:
        folder = prepare_text(data, vocab_size, log, tokenizer)
        meta = prepared.read_meta(folder)
    check_length(meta["n_tokens"], seq_len)
    return folder


def _prepared(data: str) -> Path | None:
    """--data as a prepared token folder, or None (text; 'shakespeare' is the bundled corpus)."""
    return prepared.find(data) if data != "shakespeare" else None


def open_dataset(data: str, model: str, vocab_size: int, seq_len: int, seed: int, tokenizer: Path | None = None,
                 pad_documents: bool = False):
    if model == "mlp":
        return DigitsData(seed)
    # a prepared folder (checked by `prepare`), or the text's cache: built by `prepare`, returns at once
    folder = _prepared(data) or prepare_text(data, vocab_size, tokenizer=tokenizer)
    return TextData(folder, seq_len, seed, pad_documents=pad_documents)

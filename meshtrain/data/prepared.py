"""The prepared token folder: what `meshtrain prepare` writes and `train --data DIR` reads (the
private cache that `train --data TEXT` builds is one too). The format is defined here, once;
docs/data.md describes it for a reader with numpy.

    meta.json        {"format": "meshtrain-tokens", "version": 1, "dtype": "uint16" | "uint32",
                      "vocab_size", "bos_id", "eos_id", "pad_id", "tokenizer": {"kind", "sha256"},
                      "n_tokens", "documents", "shards": [{"tokens", "documents", "n_tokens",
                      "n_documents"}, ...], and where it came from: "source", "files"}
    tokens.bin       shard 0's ids, laid end to end (little-endian `dtype`)
    documents.bin    int64, little-endian: shard 0's n+1 document boundaries (0 first, its
                     token count last): document i is tokens[b[i]:b[i+1]]
    tokens-00001.bin, documents-00001.bin, ...: the shards after the first, when there are several
    tokenizer.json   the tokenizer, byte for byte (none for the byte tokenizer), beside an
                     imported folder's tokenizer_config.json and special_tokens_map.json

A shard ends at a document's end once it holds `shard_tokens` tokens: no document is split
across shards. meta.json is written last; a folder without it is incomplete. The tokenizer's
identity is the sha256 of its tokenizer.json's bytes."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np

from meshtrain.atomic import plain_name
from meshtrain.data.corpus import DataError

FORMAT = "meshtrain-tokens"
VERSION = 1
META_FILE = "meta.json"
TOKENS_FILE = "tokens.bin"
DOCUMENTS_FILE = "documents.bin"
SHARD_TOKENS = 1 << 30  # tokens in a shard before the next one starts (at a document's end)
BYTES = "bytes"  # the tokenizer kind of the byte tokenizer (ids are UTF-8 bytes)
TOKENIZER_JSON = "tokenizer.json"


def shard_files(i: int) -> tuple[str, str]:
    """(token file, boundaries file) of shard i: tokens.bin and documents.bin first."""
    return (TOKENS_FILE, DOCUMENTS_FILE) if i == 0 else (f"tokens-{i:05}.bin", f"documents-{i:05}.bin")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tokenizer_identity(tokenizer_json: Path | None) -> dict:
    """meta.json's `tokenizer`: the sha256 of a tokenizer.json's bytes, or the byte tokenizer."""
    if tokenizer_json is None:
        return {"kind": BYTES, "sha256": None}
    return {"kind": TOKENIZER_JSON, "sha256": file_sha256(tokenizer_json)}


class TokenWriter:
    """Documents' ids appended shard by shard into `folder`; `close` writes meta.json last."""

    def __init__(self, folder: Path, dtype: np.dtype, shard_tokens: int = SHARD_TOKENS):
        self.folder, self.dtype, self.shard_tokens = Path(folder), np.dtype(dtype), shard_tokens
        self.shards: list[dict] = []
        self._file = None
        self._bounds: list[np.ndarray] = []
        self._at = 0  # tokens in the open shard

    def add(self, ids: np.ndarray, bounds: np.ndarray) -> None:
        """Documents laid end to end (`ids`) with their n+1 boundaries in it (0 first)."""
        bounds = np.asarray(bounds, dtype=np.int64)
        first = 0  # the first document not written yet
        while first < len(bounds) - 1:
            if self._file is None:
                self._open()
            # up to the document that fills the shard (or the last one given)
            fill = int(np.searchsorted(bounds, bounds[first] + self.shard_tokens - self._at, side="left"))
            last = min(max(fill, first + 1), len(bounds) - 1)
            lo, hi = int(bounds[first]), int(bounds[last])
            np.ascontiguousarray(ids[lo:hi], dtype=self.dtype.newbyteorder("<")).tofile(self._file)
            self._bounds.append(bounds[first + 1:last + 1] - lo + self._at)
            self._at += hi - lo
            first = last
            if self._at >= self.shard_tokens:
                self._close_shard()

    def _open(self) -> None:
        self._file = open(self.folder / shard_files(len(self.shards))[0], "wb")
        self._bounds, self._at = [np.zeros(1, dtype=np.int64)], 0

    def _close_shard(self) -> None:
        self._file.close()
        self._file = None
        tokens, documents = shard_files(len(self.shards))
        bounds = np.concatenate(self._bounds)
        bounds.astype("<i8").tofile(self.folder / documents)
        self.shards.append({"tokens": tokens, "documents": documents, "n_tokens": int(bounds[-1]),
                            "n_documents": len(bounds) - 1})

    def close(self, **meta) -> dict:
        """Close the last shard and write meta.json (`meta`: the tokenizer's fields and
        provenance) last; returns it."""
        if self._file is not None or not self.shards:
            if self._file is None:
                self._open()
            self._close_shard()
        meta = {"format": FORMAT, "version": VERSION, "dtype": self.dtype.name, **meta,
                "n_tokens": sum(s["n_tokens"] for s in self.shards),
                "documents": sum(s["n_documents"] for s in self.shards), "shards": self.shards}
        tmp = self.folder / f".{META_FILE}.tmp{os.getpid()}"
        tmp.write_text(json.dumps(meta, indent=1))
        os.replace(tmp, self.folder / META_FILE)
        return meta


def building_folder(out: Path, pid: int) -> Path:
    """Where process `pid` builds the token folder `out` (hidden, beside it) before renaming it into place."""
    return out.with_name(f".{out.name}.tmp{pid}")


def is_building_folder(folder: Path, out: Path | None = None) -> bool:
    """A folder named as `building_folder` names them (`out`'s, or any)."""
    name = re.escape(out.name) if out is not None else ".+"
    return re.fullmatch(rf"\.{name}\.tmp\d+", folder.name) is not None


def find(data: str) -> Path | None:
    """`--data` as a prepared token folder (a folder whose meta.json names this format, of any
    version: `read_meta` refuses another), or None (text). A token folder of an older
    meshtrain, without a format, and an unfinished one (a prepare's building folder, or token
    files without meta.json: its prepare was interrupted) are refused in one line."""
    folder = Path(data)
    meta_file = folder / META_FILE
    if folder.is_dir() and not meta_file.is_file() and (is_building_folder(folder.resolve())
                                                         or (folder / TOKENS_FILE).is_file()):
        raise DataError(f"--data {data}: an unfinished token folder (no {META_FILE}: its `meshtrain prepare` was "
                        f"interrupted); prepare it again: meshtrain prepare --data TEXT --out DIR")
    if not folder.is_dir() or not meta_file.is_file():
        return None
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        meta = None
    if isinstance(meta, dict) and meta.get("format") == FORMAT:
        return folder
    if (folder / TOKENS_FILE).is_file():
        raise DataError(f"--data {data}: a token folder of an older meshtrain (meta.json names no format); prepare "
                        f"it again: meshtrain prepare --data TEXT --out DIR")
    return None


def read_meta(folder: Path) -> dict:
    """A prepared folder's meta.json, checked: this format and version, every shard's files
    there at their size. One line for anything else."""
    folder = Path(folder)
    try:
        meta = json.loads((folder / META_FILE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"--data {folder}: no readable {META_FILE} ({e}); prepare it again") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DataError(f"--data {folder}: {META_FILE} is not a meshtrain token folder's (no \"format\": "
                        f"\"{FORMAT}\")")
    if meta.get("version") != VERSION:
        raise DataError(f"--data {folder}: a token folder of format version {meta.get('version')!r}; this meshtrain "
                        f"reads version {VERSION}: prepare it again with this version (meshtrain prepare --data TEXT "
                        f"--out DIR)")
    itemsize = np.dtype(meta["dtype"]).itemsize
    for shard in meta["shards"]:
        for name, size in ((shard["tokens"], shard["n_tokens"] * itemsize),
                           (shard["documents"], (shard["n_documents"] + 1) * 8)):
            if not plain_name(name):
                raise DataError(f"--data {folder}: {META_FILE} names {name!r}, which is not a file in the folder "
                                f"(a path or '..'); only the folder's own files are read: prepare it again")
            path = folder / name
            if not path.is_file() or path.stat().st_size != size:
                have = f"{path.stat().st_size} bytes" if path.is_file() else "missing"
                raise DataError(f"--data {folder}: {name} should hold {size} bytes ({have}); prepare it again")
    return meta


class Tokens:
    """The shards' ids as one sequence, memory-mapped: `len`, and slices (copied where a slice
    spans two shards)."""

    def __init__(self, folder: Path, meta: dict):
        dtype = np.dtype(meta["dtype"]).newbyteorder("<")
        self.shards = [np.memmap(Path(folder) / s["tokens"], dtype=dtype, mode="r") if s["n_tokens"]
                       else np.zeros(0, dtype=dtype) for s in meta["shards"]]
        self.starts = np.cumsum([0] + [len(s) for s in self.shards])
        self.dtype = dtype

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: slice) -> np.ndarray:
        lo, hi, _ = index.indices(len(self))
        first = int(np.searchsorted(self.starts, lo, side="right")) - 1
        if first < len(self.shards) and hi <= self.starts[first + 1]:
            return self.shards[first][lo - self.starts[first]:hi - self.starts[first]]
        parts = []
        for i in range(max(first, 0), len(self.shards)):
            a, b = max(lo, self.starts[i]), min(hi, self.starts[i + 1])
            if a < b:
                parts.append(self.shards[i][a - self.starts[i]:b - self.starts[i]])
        return np.concatenate(parts) if parts else np.zeros(0, dtype=self.dtype)


def document_bounds(folder: Path, meta: dict) -> np.ndarray:
    """The n+1 boundaries of every document in the shards' ids laid end to end (`Tokens`)."""
    out, offset = [np.zeros(1, dtype=np.int64)], 0
    for s in meta["shards"]:
        b = np.fromfile(Path(folder) / s["documents"], dtype="<i8").astype(np.int64)
        out.append(b[1:] + offset)
        offset += s["n_tokens"]
    return np.concatenate(out)


def check_tokenizer(folder: Path, meta: dict, tokenizer_json: Path) -> None:
    """A prepared folder used with --init-from: tokenized by that folder's tokenizer.json (the
    sha256 of its bytes), else refused in one line."""
    theirs = meta.get("tokenizer") or {}
    mine = file_sha256(tokenizer_json)
    if theirs.get("sha256") != mine:
        what = ("the byte tokenizer" if theirs.get("kind") == BYTES else
                f"another tokenizer.json (sha256 {str(theirs.get('sha256'))[:12]}…)")
        raise DataError(f"--data {folder} was prepared with {what}, not --init-from's {tokenizer_json} (sha256 "
                        f"{mine[:12]}…); prepare it with that tokenizer: meshtrain prepare --data TEXT --init-from "
                        f"{tokenizer_json.parent} --out DIR")

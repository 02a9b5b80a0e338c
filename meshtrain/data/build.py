"""Text tokenized into a prepared token folder (`prepared.py`'s format), at any size.

The parent process streams the documents (`corpus.iter_documents`: .jsonl line by line,
Parquet record batch by record batch), cuts them into batches of a bounded size and writes
their ids in input order as the shards fill; the batches are encoded in place (1 worker)
or by worker processes, each of which loads the tokenizer once and encodes one batch at a
time. The ids are the same with 1 worker and with N (a batch's ids do not depend on which
process encodes it), and memory does not grow with the corpus: docs/data.md states the
bound and the figures measured.

`meshtrain prepare` builds in a hidden folder beside --out (`prepared.building_folder`),
locked while its process lives and renamed into place at the end, so that --out is whole or
absent; a building folder whose lock is free (its prepare was killed) is removed by the
next prepare into the same --out. Nothing here imports torch."""

from __future__ import annotations

import fcntl
import json
import multiprocessing
import os
import shutil
import signal
import sys
import time
from collections import deque
from contextlib import closing, contextmanager
from pathlib import Path

from meshtrain.data import prepared
from meshtrain.data.corpus import TEXT_FIELD, DataError, check_files, iter_documents, text_files
from meshtrain.data.tokenizer import (TOKENIZER_FILE, BPETokenizer, ByteTokenizer, Specials, imported_specials,
                                      token_dtype)
from meshtrain.launch import die_with_parent

# A batch: at most this many documents and characters (a longer document is a batch alone).
_DOCS_PER_BATCH, _CHARS_PER_BATCH = 4096, 1 << 20
# An imported folder's files copied into a prepared folder, byte for byte (AutoTokenizer reads them there)
IMPORTED_TOKENIZER_FILES = (TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json")


def default_workers() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def usable_vocab(vocab_size: int) -> int:
    """The byte tokenizer is the fallback when `tokenizers` is missing."""
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        if vocab_size != ByteTokenizer.vocab_size:
            print("meshtrain: `tokenizers` is not installed; using the byte tokenizer (vocab 256)", file=sys.stderr)
        return ByteTokenizer.vocab_size
    return vocab_size


def imported_tokenizer_and_rows(folder: Path) -> tuple[Path, int]:
    """A Hugging Face folder's tokenizer.json and the embedding rows its ids must fit
    (config.json's `vocab_size`; without a config.json, the tokenizer's own size)."""
    tokenizer = folder / TOKENIZER_FILE
    if not tokenizer.is_file():
        raise DataError(f"--init-from {folder}: no {TOKENIZER_FILE} there; give a Hugging Face folder with its "
                        f"tokenizer")
    config = folder / "config.json"
    if not config.is_file():
        return tokenizer, BPETokenizer.load(tokenizer).vocab_size
    try:
        rows = json.loads(config.read_text(encoding="utf-8")).get("vocab_size")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise DataError(f"--init-from {config}: not a JSON object ({e}); fix or remove it") from None
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
        raise DataError(f"--init-from {config}: no positive integer vocab_size ({rows!r})")
    return tokenizer, rows


def prepare_folder(source: str, out: Path, vocab_size: int, tokenizer: Path | None = None, log=None,
                   shard_tokens: int = prepared.SHARD_TOKENS, workers: int = 1, text_field: str = TEXT_FIELD,
                   progress: bool = False) -> dict:
    """`meshtrain prepare`: the text of `source` tokenized into the new folder `out`
    (`build_folder`), built in a locked folder beside it and renamed into place at the end,
    so that `out` is whole or absent, whatever stops this process. Returns its meta.json."""
    log = log or _to_stderr
    files = text_files(source)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"--out {out} exists and is not empty; give a new folder (or remove that one)")
    if tokenizer is None:
        vocab_size = usable_vocab(vocab_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(out, log)
    tmp = prepared.building_folder(out, os.getpid())  # one of a dead process of this pid was removed just now
    tmp.mkdir()
    lock = _try_lock(tmp)
    try:
        meta = build_folder(tmp, files, source, vocab_size, log, tokenizer, shard_tokens, workers=workers,
                            text_field=text_field, progress=progress)
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        os.close(lock)
    return meta


def _try_lock(folder: Path) -> int | None:
    """An exclusive lock on the folder itself (flock on its descriptor: released by the
    kernel however the process ends, and moved with the folder by a rename); None if another
    process holds it."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _remove_abandoned(out: Path, log) -> None:
    """Building folders of earlier prepares into `out`: one whose lock is free (its process
    was killed) is removed, in one line; one locked (a prepare into `out` runs now) refuses."""
    for folder in sorted(out.parent.iterdir()):
        if not (folder.is_dir() and prepared.is_building_folder(folder, out)):
            continue
        lock = _try_lock(folder)
        if lock is None:
            raise DataError(f"--out {out}: another `meshtrain prepare` is writing it now (in {folder}); wait for it "
                            f"or give another --out")
        try:
            shutil.rmtree(folder)
        finally:
            os.close(lock)
        log(f"removed {folder}, the unfinished folder of an interrupted prepare into --out {out}")


def _to_stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


def build_folder(folder: Path, files: list[Path], source: str, vocab_size: int, log,
                 imported: Path | None = None, shard_tokens: int = prepared.SHARD_TOKENS, workers: int = 1,
                 text_field: str = TEXT_FIELD, progress: bool = False) -> dict:
    """Tokenize the documents of `files` into the prepared folder `folder` (`prepared.py`),
    streamed and written batch by batch (`_encoded`, by `workers` processes): with the
    `imported` tokenizer.json (copied there byte for byte, with the files beside it that name
    its special tokens), the byte tokenizer (`vocab_size` 256), or a BPE of `vocab_size`
    trained on the text first (a pass of its own over the streamed documents). `progress`:
    a bar on stderr when it is a terminal, and a line of the rate at the end. Returns
    meta.json. Text with no character is refused in one line."""
    check_files(files, text_field)
    total = sum(p.stat().st_size for p in files)

    def no_text() -> DataError:
        return DataError(f"--data {source}: no text there ({len(files)} file(s), every document empty); give text "
                         f"files, or .jsonl or Parquet files with a \"{text_field}\" field")

    if imported is not None:
        tokenizer_json, specials, vocab = _import_tokenizer(folder, imported, vocab_size)
    elif vocab_size == ByteTokenizer.vocab_size:
        tokenizer_json, specials, vocab = None, Specials(), vocab_size
    else:
        log(f"training a {vocab_size}-token BPE tokenizer on the text of {len(files)} file(s) ...")
        tokenizer_json = folder / TOKENIZER_FILE
        with closing(_Meter(total, "training the BPE", progress)) as meter:
            if not _train_bpe(files, text_field, vocab_size, tokenizer_json, meter):
                raise no_text()
        tokenizer = BPETokenizer.load(tokenizer_json)
        specials, vocab = tokenizer.own_specials(), tokenizer.vocab_size
    identity = prepared.tokenizer_identity(tokenizer_json)
    writer = prepared.TokenWriter(folder, token_dtype(vocab), shard_tokens)
    meter = _Meter(total, "tokenizing", progress, tokens=True)
    docs = meter.count(iter_documents(files, text_field, meter.read))
    with closing(meter), closing(_encoded(_batches(docs), tokenizer_json, specials, workers)) as encoded:
        for ids, bounds in encoded:
            writer.add(ids, bounds)
            meter.wrote(len(ids))
    if not meter.chars:
        raise no_text()
    if progress:
        log(f"tokenized {total / 1e6:,.1f} MB into {meter.tokens:,} tokens in {meter.elapsed():.1f} s: "
            f"{meter.tokens / meter.elapsed():,.0f} tokens/s with {workers} worker(s)")
    return writer.close(vocab_size=vocab, bos_id=specials.bos, eos_id=specials.eos, pad_id=specials.pad,
                        tokenizer=identity, source=source, files=len(files))


def _import_tokenizer(folder: Path, imported: Path, vocab_size: int) -> tuple[Path, Specials, int]:
    """An imported tokenizer.json checked against the model's `vocab_size` rows and copied
    into `folder` with the files that name its special tokens: (the copy, its specials, the
    vocabulary meta.json records)."""
    tokenizer = BPETokenizer.load(imported)
    if tokenizer.vocab_size > vocab_size:
        raise DataError(f"{imported}: the tokenizer has {tokenizer.vocab_size:,} tokens, more than the model's "
                        f"{vocab_size:,} embedding rows")
    specials = imported_specials(imported.parent, tokenizer, vocab_size)
    for name in IMPORTED_TOKENIZER_FILES:
        there = imported if name == TOKENIZER_FILE else imported.with_name(name)
        if there.is_file():
            shutil.copyfile(there, folder / name)
    return folder / TOKENIZER_FILE, specials, vocab_size


def _batches(docs):
    """(documents, whether they are the last) in batches of a bounded size."""
    batch, chars = [], 0
    for doc in docs:
        if batch and (len(batch) >= _DOCS_PER_BATCH or chars + len(doc) > _CHARS_PER_BATCH):
            yield batch, False  # `doc` follows
            batch, chars = [], 0
        batch.append(doc)
        chars += len(doc)
    yield batch, True


class _Encoder:
    """What encodes a batch: the folder's tokenizer (None: the byte tokenizer), loaded once,
    and its special ids."""

    def __init__(self, tokenizer_json: Path | None, specials: Specials):
        self.tokenizer = ByteTokenizer() if tokenizer_json is None else BPETokenizer.load(tokenizer_json)
        self.specials = specials

    def __call__(self, batch: list[str], last: bool):
        return self.tokenizer.encode_documents(batch, self.specials, last=last)


class _Died(Exception):
    """A process of this prepare ended without answering (killed: the kernel's OOM killer)."""


class _Process:
    """A spawned process (nothing of this process's threads or torch inherited) serving
    tasks one at a time over a pipe of its own: its death is seen as the pipe's end, and it
    can be stopped at any moment. (`concurrent.futures`' pool hangs for ever when a worker
    is stopped while it sends a result: its reader thread waits for the rest of the message.)"""

    def __init__(self, setup, args: tuple):
        ctx = multiprocessing.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(theirs, os.getpid(), setup, args), daemon=True)
        self.process.start()
        theirs.close()  # this end alone in the process: its death ends the pipe

    def submit(self, *task) -> None:
        try:
            self.conn.send(task)
        except OSError:
            raise _Died from None

    def result(self):
        try:
            ok, value = self.conn.recv()
        except (EOFError, OSError):
            raise _Died from None
        if not ok:
            raise value
        return value

    def stop(self) -> None:
        self.process.terminate()
        self.process.join()
        self.conn.close()


def _serve(conn, parent: int, setup, args: tuple) -> None:
    """A process's life: Ctrl-C left to the parent (which stops it), dead with the parent
    however it dies, `setup(*args)` once (the tokenizer loaded), then each task answered
    with (True, its result) or (False, the exception it raised)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent, signal.SIGKILL)
    try:
        serve = setup(*args)
    except Exception as e:  # said at the first task, rather than as a death
        def serve(*task, e=e):
            raise e
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        try:
            reply = (True, serve(*task))
        except Exception as e:  # said in the parent, as if raised there
            reply = (False, e)
        conn.send(reply)


@contextmanager
def _processes(n: int, setup, *args):
    """`n` processes, each set up by `setup(*args)`; all stopped when the block ends,
    whatever ends it (an error, Ctrl-C, SIGTERM, a generator closed); one that died is said
    in one line."""
    processes = []
    try:
        for _ in range(n):
            processes.append(_Process(setup, args))
        yield processes
    except _Died:
        fewer = f"use fewer --workers than {n}" if n > 1 else "give the BPE fewer distinct words"
        raise DataError(f"a process of `meshtrain prepare` died (killed: out of memory?); {fewer}, or free "
                        f"memory") from None
    finally:
        for process in processes:
            process.stop()


def _encoder(tokenizer_json: Path | None, specials: Specials) -> _Encoder:
    """A worker's setup: one thread of `tokenizers` (the workers are the parallelism)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    return _Encoder(tokenizer_json, specials)


def _encoded(batches, tokenizer_json: Path | None, specials: Specials, workers: int):
    """The batches' (ids, boundaries), in input order: encoded here (1 worker), or by
    `workers` processes, one batch each at a time, in turn: a batch goes to a worker only
    once it has handed back its last one (so neither ever waits on the other's pipe), and
    the ids come back in the order the batches went."""
    if workers == 1:
        encode = _Encoder(tokenizer_json, specials)
        yield from (encode(batch, last) for batch, last in batches)
        return
    with _processes(workers, _encoder, tokenizer_json, specials) as pool:
        busy = deque()  # the workers with a batch, in the order the batches went
        for batch, last in batches:
            if len(busy) < workers:
                worker = pool[len(busy)]
            else:
                worker = busy.popleft()
                yield worker.result()
            worker.submit(batch, last)
            busy.append(worker)
        while busy:
            yield busy.popleft().result()


def _trainer(bytes_read):
    """The BPE trainer's setup: its task trains on the streamed documents, counting the
    input bytes read into `bytes_read` (shared with the parent's progress bar), saves the
    tokenizer and returns the documents' characters."""
    def read(n: int) -> None:
        bytes_read.value += n

    def train(files: list[Path], text_field: str, vocab_size: int, tokenizer_json: Path) -> int:
        tally = _Tally()
        docs = tally.count(iter_documents(files, text_field, read))
        BPETokenizer.train_documents(docs, vocab_size).save(tokenizer_json)
        return tally.chars
    return train


def _train_bpe(files: list[Path], text_field: str, vocab_size: int, tokenizer_json: Path, meter: "_Meter") -> int:
    """A BPE of `vocab_size` tokens trained on the documents, saved to `tokenizer_json`, in a
    process of its own: `tokenizers` trains in threads that never give this process's main
    thread back to Python, which could then not stop on Ctrl-C or SIGTERM until the end.
    The word counts it keeps grow with the distinct words, not with the text. Returns the
    documents' characters (0: no text)."""
    bytes_read = multiprocessing.get_context("spawn").Value("q", 0, lock=False)
    with _processes(1, _trainer, bytes_read) as (trainer,):
        trainer.submit(files, text_field, vocab_size, tokenizer_json)
        while not trainer.conn.poll(0.2):
            meter.read(bytes_read.value - meter.bytes)
        meter.read(bytes_read.value - meter.bytes)
        return trainer.result()


class _Tally:
    """The documents' characters (none at all: no text)."""

    def __init__(self):
        self.chars = 0

    def count(self, docs):
        for doc in docs:
            self.chars += len(doc)
            yield doc


class _Meter(_Tally):
    """Input bytes read and tokens written: a tqdm bar on stderr (shown on a terminal only)
    with tokens/s, and the totals. (Never in a worker: tqdm's lock is a semaphore, which a
    worker stopped mid-task would leave for the resource tracker to warn about.)"""

    def __init__(self, total_bytes: int, what: str, show: bool, tokens: bool = False):
        from tqdm import tqdm
        super().__init__()
        self.bar = tqdm(total=total_bytes, desc=what, unit="B", unit_scale=True, file=sys.stderr, leave=False,
                        disable=None if show else True, dynamic_ncols=True, postfix="0 tokens/s" if tokens else None)
        self.bytes = self.tokens = 0
        self.start = time.perf_counter()

    def read(self, n: int) -> None:
        self.bytes += n
        self.bar.update(n)

    def wrote(self, tokens: int) -> None:
        self.tokens += tokens
        self.bar.set_postfix_str(f"{self.tokens / self.elapsed():,.0f} tokens/s", refresh=False)

    def elapsed(self) -> float:
        return max(time.perf_counter() - self.start, 1e-9)

    def close(self) -> None:
        self.bar.close()

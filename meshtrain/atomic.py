"""Files are written under a temporary name and renamed into place, so that a reader (another
rank, a later run) never sees half a file; a name read from a folder's own index is taken
only when it names a file in that folder."""

import os
from pathlib import Path
from typing import Callable


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Call `write(tmp)` on a temporary path beside `path`, then rename it to `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)


def plain_name(name) -> bool:
    """Whether `name` (read from a folder's index or marker: a checkpoint's, a prepared token
    folder's meta.json) names a file inside that folder: a plain file name, not a path (no
    separator, not `..`)."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name)

"""Files are written under a temporary name and renamed into place, so that a reader (another
rank, a later run) never sees half a file."""

import os
from pathlib import Path
from typing import Callable


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Call `write(tmp)` on a temporary path beside `path`, then rename it to `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)

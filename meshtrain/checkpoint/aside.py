"""Nothing an output folder holds is deleted to make room for what comes next: `--overwrite`
(a fresh run's, `owner.claim`; an export's, `cli.export_out`) renames the old files into a
new `FOLDER/replaced-<time>/` beside it; a roll-back (`lineage.roll_back`) the abandoned
branch into `OUT/rolled-back-<time>/`. No torch."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Iterable

ASIDE_PREFIX = "replaced-"


def move_into_aside(folder: Path, names: Iterable[str], prefix: str = ASIDE_PREFIX) -> Path:
    """Rename the entries `names` of `folder` into a new `folder/<prefix><time>/` and return
    it (renames within one folder: nothing is copied or deleted)."""
    folder = Path(folder)
    aside = folder / f"{prefix}{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
    aside.mkdir()
    for name in sorted(names):
        os.replace(folder / name, aside / name)
    return aside

"""The command line's progress lines: `meshtrain: ...` on stderr, flushed at once."""

import sys


def log(msg: str) -> None:
    print(f"meshtrain: {msg}", file=sys.stderr, flush=True)

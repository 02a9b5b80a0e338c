"""Which safetensors files a folder of weights holds: one `model.safetensors`, or the shards
Hugging Face's index lists. No torch: the command line checks an `--init-from` folder before
torch loads."""

from __future__ import annotations

import json
from pathlib import Path

WEIGHTS = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"


class WeightFilesError(ValueError):
    """A folder with no safetensors weights meshtrain can read: one line."""


def weight_files(folder: Path) -> list[Path]:
    """The folder's safetensors files: one, or those its index lists."""
    folder = Path(folder)
    if (folder / WEIGHTS).is_file():
        return [folder / WEIGHTS]
    if (folder / SHARD_INDEX).is_file():
        names = sorted(set(json.loads((folder / SHARD_INDEX).read_text())["weight_map"].values()))
        return [folder / n for n in names]
    if (folder / "params.json").is_file() or list(folder.glob("consolidated.*.pth")):
        raise WeightFilesError(f"{folder}: Meta's original format (params.json, consolidated.*.pth); convert it "
                               f"with transformers' convert_llama_weights_to_hf.py first")
    raise WeightFilesError(f"{folder}: no {WEIGHTS} or {SHARD_INDEX}")

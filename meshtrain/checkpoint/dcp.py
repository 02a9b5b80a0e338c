"""torch.distributed.checkpoint (DCP) carrying boxes: each rank writes the boxes it owns of
each tensor (`boxes.Box`), DCP removes the duplicates of replicas (one writer each), checks
that the boxes tile every tensor exactly, and on load computes which saved boxes overlap the
boxes a rank needs, reading only those.

Built on DCP's public planner API rather than `ShardedTensor` (deprecated) or DTensor (a
ZeRO piece is a flat range, which no DTensor placement describes): the save planner makes
one `WriteItem` per box and hands DCP the box's view (`resolve_data`); the load planner
asks `create_read_items_for_chunk_list` for the reads and returns views of rank memory to
copy into (`resolve_tensor`), so nothing is staged beyond the saved box being read.

Nothing is unpickled: tensors are read with `weights_only=True` (DCP's own reader), no
bytes are stored (`load_bytes` refuses them), and the index DCP pickles (`.metadata`) is
also written as JSON (`index.json`), which is what we read (`.metadata` stays for torch's
own tools)."""

from __future__ import annotations

import json
import warnings
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from meshtrain.checkpoint.boxes import Box
from meshtrain.checkpoint.folders import CheckpointError, plain_name, write_synced

INDEX = "index.json"
FORMAT = "meshtrain-dcp-1"
# The dtypes an index may name (read by name from JSON: nothing else of torch is looked up).
DTYPES = {name: getattr(torch, name) for name in ("float64", "float32", "float16", "bfloat16", "int64", "int32",
                                                  "int16", "int8", "uint8", "bool", "complex64", "complex128",
                                                  "float8_e4m3fn", "float8_e5m2")}


@dataclass
class Boxed:
    """One tensor of the full state as this rank holds it: its full shape and dtype, and the
    boxes of it this rank has (possibly none; on load, possibly overlapping: every copy
    this rank keeps is filled)."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    boxes: list[Box]


def _chunk(box: Box) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes))


class BoxSavePlanner(DefaultSavePlanner):
    """One write item per box; DCP's global plan dedups replicas and validates the tiling."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        self.state_dict, self.is_coordinator = state_dict, is_coordinator
        self._views = {(fqn, tuple(b.offsets)): b.view for fqn, t in state_dict.items() for b in t.boxes}

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, t in self.state_dict.items():
            props = TensorProperties(dtype=t.dtype)
            for b in t.boxes:
                items.append(WriteItem(index=MetadataIndex(fqn, torch.Size(b.offsets)), type=WriteItemType.SHARD,
                                       tensor_data=TensorWriteData(chunk=_chunk(b), properties=props,
                                                                   size=torch.Size(t.shape))))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        return self._views[(write_item.index.fqn, tuple(write_item.index.offset))].detach()


class BoxLoadPlanner(DefaultLoadPlanner):
    """Reads the saved boxes that overlap this rank's boxes, straight into their views."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.state_dict, self.metadata, self.is_coordinator = state_dict, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        reads = []
        for fqn, t in self.state_dict.items():
            if t.boxes:
                reads += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn],
                                                          [_chunk(b) for b in t.boxes])
        return LoadPlan(reads)

    def resolve_tensor(self, read_item) -> torch.Tensor:
        view = self.state_dict[read_item.dest_index.fqn].boxes[read_item.dest_index.index].view
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, start, length)
        return view

    def commit_tensor(self, read_item, tensor) -> None:
        pass

    def load_bytes(self, read_item, value) -> None:
        raise ValueError(f"checkpoint entry {read_item.dest_index.fqn!r} is pickled bytes; a meshtrain checkpoint "
                         "holds none (is this folder from another tool?)")


class _Summed:
    """A file being written, its size and CRC-32 kept as bytes pass (no reading back)."""

    def __init__(self, stream):
        self._stream, self.size, self.crc = stream, 0, 0

    def write(self, data) -> int:
        n = self._stream.write(data)
        self.crc = zlib.crc32(data, self.crc)
        self.size += len(memoryview(data).cast("B"))
        return n

    def __getattr__(self, name):
        return getattr(self._stream, name)


class SummingFileSystem(FileSystem):
    """DCP's local file system, recording each written file's description (`folders.describe`'s
    form) as it is written, across DCP's write-then-rename of its metadata."""

    def __init__(self):
        super().__init__()
        self.written: dict[str, dict] = {}

    @contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            summed = _Summed(stream)
            yield summed
        self.written[Path(path).name] = {"bytes": summed.size, "crc32": summed.crc}

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        if Path(path).name in self.written:
            self.written[Path(new_path).name] = self.written.pop(Path(path).name)


class IndexedWriter(FileSystemWriter):
    """DCP's file writer that also writes its index as JSON, and describes what it wrote."""

    def __init__(self, path):
        super().__init__(path, single_file_per_rank=True, sync_files=True)
        self.fs = SummingFileSystem()
        self._folder = Path(path)

    @property
    def written(self) -> dict[str, dict]:
        return self.fs.written

    def finish(self, metadata: Metadata, results) -> None:
        super().finish(metadata, results)
        tensors = {fqn: {"dtype": str(md.properties.dtype).removeprefix("torch."), "size": list(md.size),
                         "chunks": [[list(c.offsets), list(c.sizes)] for c in md.chunks]}
                   for fqn, md in metadata.state_dict_metadata.items()}
        storage = [[index.fqn, list(index.offset), info.relative_path, info.offset, info.length,
                    getattr(info, "transform_descriptors", None)] for index, info in metadata.storage_data.items()]
        text = json.dumps({"format": FORMAT, "version": metadata.version, "tensors": tensors, "storage": storage})
        self.fs.written[INDEX] = write_synced(self._folder / INDEX, text.encode())


class IndexedReader(FileSystemReader):
    """DCP's file reader, its index read from the JSON (never the pickle)."""

    def __init__(self, path, metadata: Metadata | None = None):
        super().__init__(path)
        self._folder, self._metadata = Path(path), metadata

    def read_metadata(self, *args, **kwargs) -> Metadata:
        return self._metadata if self._metadata is not None else read_index(self._folder)


def read_index(folder: Path) -> Metadata:
    """DCP's metadata of the checkpoint in `folder`, from its JSON index; refuses
    (`CheckpointError`, one line) an index naming a file outside the folder (a path, not a
    file name) or a dtype not in `DTYPES`."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    where = Path(folder) / INDEX
    raw = json.loads(where.read_text())
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise CheckpointError(f"{where}: not a meshtrain checkpoint index")
    for t in raw["tensors"].values():
        if t["dtype"] not in DTYPES:
            raise CheckpointError(f"{where} holds a tensor of dtype {t['dtype']!r}, not one of {', '.join(DTYPES)} "
                                  f"(a damaged index?)")
    for entry in raw["storage"]:
        if not plain_name(entry[2]):
            raise CheckpointError(f"{where} names {entry[2]!r}, which is not a file in the checkpoint's folder "
                                  f"(a damaged index?)")
    md = {fqn: TensorStorageMetadata(properties=TensorProperties(dtype=DTYPES[t["dtype"]]),
                                     size=torch.Size(t["size"]),
                                     chunks=[ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in t["chunks"]])
          for fqn, t in raw["tensors"].items()}
    storage = {}
    for fqn, offset, path, start, length, transforms in raw["storage"]:
        info = _StorageInfo(path, start, length)
        if transforms is not None:
            info.transform_descriptors = transforms
        storage[MetadataIndex(fqn, torch.Size(offset))] = info
    return Metadata(state_dict_metadata=md, storage_data=storage, storage_meta=StorageMeta(), version=raw["version"])


def save(state: dict[str, Boxed], folder: Path, distributed: bool) -> dict[str, dict]:
    """Collective (every rank of the default group, when `distributed`): write `state`;
    returns the description of each file this rank wrote. A dtype that `read_index` would
    refuse is refused here, before anything is written."""
    odd = next((fqn for fqn, b in state.items() if b.dtype not in DTYPES.values()), None)
    if odd is not None:
        raise CheckpointError(f"checkpoint: {odd} is {state[odd].dtype}, which checkpoints do not hold (they hold "
                              f"{', '.join(DTYPES)})")
    writer = IndexedWriter(folder)
    with _one_process_quietly(distributed):
        dcp.save(state, storage_writer=writer, planner=BoxSavePlanner(), no_dist=not distributed)
    return writer.written


def load(state: dict[str, Boxed], folder: Path, distributed: bool, metadata: Metadata | None = None) -> None:
    """Collective: fill every box of `state` from the checkpoint in `folder` (its index
    `metadata`, when the caller has read it already: read once)."""
    with _one_process_quietly(distributed):
        dcp.load(state, storage_reader=IndexedReader(folder, metadata), planner=BoxLoadPlanner(),
                 no_dist=not distributed)


@contextmanager
def _one_process_quietly(distributed: bool):
    """DCP warns that it assumes one process when no group exists: here that is the intent."""
    with warnings.catch_warnings():
        if not distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield

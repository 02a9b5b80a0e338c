"""torch.distributed.checkpoint (DCP) carrying boxes: each rank writes the boxes it owns of
each tensor (`boxes.Box`), DCP removes the duplicates of replicas (one writer each), checks
that the boxes tile every tensor exactly, and on load computes which saved boxes overlap the
boxes a rank needs, reading only those.

Built on DCP's public planner API rather than `ShardedTensor` (deprecated) or DTensor (a
ZeRO piece is a flat range, which no DTensor placement describes): the save planner makes
one `WriteItem` per box and hands DCP the box's view (`resolve_data`); the load planner
asks `create_read_items_for_chunk_list` for the reads and returns views of rank memory to
copy into (`resolve_tensor`), so nothing is staged beyond the saved box being read.

The storage is ours, through DCP's public `StorageWriter`/`StorageReader` API: each rank
writes one file of its boxes' raw bytes (row-major, little-endian, laid end to end), one
sequential write, with no serializer per box (`torch.save` per box made a save of thousands
of small tensors ten times `torch.save`'s time); the index (`index.json`) says where each box
lies and its CRC-32, taken as it was written. A load reads each stored box it needs once,
in file order, and checks its CRC-32 on exactly those bytes: a resharding load reads parts of
files, so whole-file checksums could not be checked without reading everything twice.

Nothing is unpickled: the index is JSON, tensors are raw bytes of a dtype the index names
(`DTYPES`), and a checkpoint of format 1 (each box a `torch.save` record, and a pickled
`.metadata` beside) is still read, with `weights_only=True`."""

from __future__ import annotations

import gc
import json
import logging
import os
import warnings
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from meshtrain.checkpoint.boxes import Box
from meshtrain.atomic import plain_name
from meshtrain.checkpoint.folders import CheckpointError, write_synced

INDEX = "index.json"
FORMAT = "meshtrain-dcp-2"  # 2: raw bytes, a CRC-32 per box; 1: a torch.save record per box
FORMATS = ("meshtrain-dcp-1", FORMAT)  # what a load reads
DCP_VERSION = "1.0.0"  # the metadata version DCP's own writer records
DATA_SUFFIX = ".distcp"
DCP_LOGGER = "c10d-NullHandler-dcp_logger"  # torch.distributed.checkpoint.logger's
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


@dataclass
class Stored(_StorageInfo):
    """Where one saved box's bytes lie in its file, and their CRC-32 (format 2; None in 1)."""
    crc32: int | None = None


def raw_bytes(t: torch.Tensor) -> memoryview:
    """A tensor's bytes as stored: row-major, in host byte order (little-endian wherever torch
    runs), on the CPU (a device tensor is copied; a strided view made contiguous)."""
    t = t.detach()
    t = t.cpu() if t.device.type != "cpu" else t.contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class IndexedWriter(FileSystemWriter):
    """Each rank's boxes as raw bytes into one file, written in one sequential pass with the
    CRC-32 of each box taken as it goes; the coordinator writes the index as JSON. Describes
    each file it wrote (`folders.describe`'s form; a data file's bytes are checked by item)."""

    def __init__(self, path):
        super().__init__(path, single_file_per_rank=True, sync_files=True)
        self._folder = Path(path)
        self.written: dict[str, dict] = {}

    def write_data(self, plan: SavePlan, planner) -> Future:
        name = f"{plan.storage_data.prefix}0{DATA_SUFFIX}"
        results, at = [], 0
        with open(self._folder / name, "wb") as f:
            for item in plan.items:
                data = raw_bytes(planner.resolve_data(item))
                f.write(data)
                results.append(WriteResult(index=item.index, size_in_bytes=data.nbytes,
                                           storage_data=Stored(relative_path=name, offset=at, length=data.nbytes,
                                                              crc32=zlib.crc32(data))))
                at += data.nbytes
            f.flush()
            os.fsync(f.fileno())
        self.written[name] = {"bytes": at, "checked": "by item"}
        done: Future = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results) -> None:
        tensors = {fqn: {"dtype": str(md.properties.dtype).removeprefix("torch."), "size": list(md.size),
                         "chunks": [[list(c.offsets), list(c.sizes)] for c in md.chunks]}
                   for fqn, md in metadata.state_dict_metadata.items()}
        storage = [[r.index.fqn, list(r.index.offset), r.storage_data.relative_path, r.storage_data.offset,
                    r.storage_data.length, r.storage_data.crc32] for part in results for r in part]
        text = json.dumps({"format": FORMAT, "version": DCP_VERSION, "tensors": tensors, "storage": storage})
        self.written[INDEX] = write_synced(self._folder / INDEX, text.encode())


class IndexedReader(FileSystemReader):
    """The reader of our files: the index read from the JSON (never a pickle); each stored
    box a rank needs read once, in file order, its CRC-32 checked on the bytes read, then
    copied into every place that needs a part of it. A bad box is recorded in `problem`
    (one line) and the load goes on, so that every rank reaches the caller's collective
    verdict. `reads`: (file, offset, length) of each read, for the caller to account."""

    def __init__(self, path, metadata: Metadata | None = None):
        super().__init__(path)
        self._folder, self._metadata = Path(path), metadata
        self.reads: list[tuple[str, int, int]] = []
        self.problem: str | None = None

    def read_metadata(self, *args, **kwargs) -> Metadata:
        return self._metadata if self._metadata is not None else read_index(self._folder)

    def read_data(self, plan: LoadPlan, planner) -> Future:
        if not all(isinstance(info, Stored) and info.crc32 is not None for info in self.storage_data.values()):
            return super().read_data(plan, planner)  # format 1: torch.save records
        by_box: dict = {}
        for req in plan.items:
            by_box.setdefault(req.storage_index, []).append(req)
        order = sorted(by_box, key=lambda i: (self.storage_data[i].relative_path, self.storage_data[i].offset))
        sizes = {(fqn, tuple(c.offsets)): (tuple(c.sizes), md.properties.dtype)
                 for fqn, md in self._metadata.state_dict_metadata.items() for c in md.chunks}
        opened: dict[str, object] = {}
        try:
            for index in order:
                info = self.storage_data[index]
                f = opened.get(info.relative_path) or opened.setdefault(
                    info.relative_path, open(self._folder / info.relative_path, "rb"))
                stored = self._read(f, info, index)
                if stored is None:
                    continue
                shape, dtype = sizes[(index.fqn, tuple(index.offset))]
                tensor = stored.view(dtype).view(shape)
                for req in by_box[index]:
                    target = planner.resolve_tensor(req).detach()
                    target.copy_(_narrow(tensor, req.storage_offsets, req.lengths))
                    planner.commit_tensor(req, target)
        finally:
            for f in opened.values():
                f.close()
        done: Future = Future()
        done.set_result(None)
        return done

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._metadata = metadata

    def _read(self, f, info: Stored, index) -> torch.Tensor | None:
        """One stored box's bytes, read once and checked; None (and `problem` set) when they
        are short or fail their checksum."""
        buf = torch.empty(info.length, dtype=torch.uint8)
        f.seek(info.offset)
        got = f.readinto(memoryview(buf.numpy()))
        self.reads.append((info.relative_path, info.offset, info.length))
        if got != info.length:
            self.problem = self.problem or (f"{info.relative_path} ends before {index.fqn}'s bytes at "
                                            f"{info.offset}+{info.length} (truncated?)")
            return None
        if zlib.crc32(memoryview(buf.numpy())) != info.crc32:
            self.problem = self.problem or (f"{info.relative_path} fails its checksum at {index.fqn} (bytes "
                                            f"{info.offset}..{info.offset + info.length}; corrupted)")
            return None
        return buf


def _narrow(t: torch.Tensor, offsets, lengths) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        t = t.narrow(dim, start, length)
    return t


def read_index(folder: Path) -> Metadata:
    """DCP's metadata of the checkpoint in `folder`, from its JSON index; refuses
    (`CheckpointError`, one line) an index naming a file outside the folder (a path, not a
    file name) or a dtype not in `DTYPES`."""
    where = Path(folder) / INDEX
    raw = json.loads(where.read_text())
    if not isinstance(raw, dict) or raw.get("format") not in FORMATS:
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
    for fqn, offset, path, start, length, last in raw["storage"]:
        # format 2's last field is the box's CRC-32; format 1's, DCP's transforms (None)
        if raw["format"] == FORMAT:
            info = Stored(relative_path=path, offset=start, length=length, crc32=last)
        else:
            info = _StorageInfo(path, start, length)
            if last is not None:
                info.transform_descriptors = last
        storage[MetadataIndex(fqn, torch.Size(offset))] = info
    return Metadata(state_dict_metadata=md, storage_data=storage, storage_meta=StorageMeta(), version=raw["version"])


def save(state: dict[str, Boxed], folder: Path, distributed: bool, process_group=None) -> dict[str, dict]:
    """Collective (every rank of `process_group`, the default group when None, when
    `distributed`): write `state`; returns the description of each file this rank wrote. A
    dtype that `read_index` would refuse is refused here, before anything is written."""
    odd = next((fqn for fqn, b in state.items() if b.dtype not in DTYPES.values()), None)
    if odd is not None:
        raise CheckpointError(f"checkpoint: {odd} is {state[odd].dtype}, which checkpoints do not hold (they hold "
                              f"{', '.join(DTYPES)})")
    writer = IndexedWriter(folder)
    with _one_process_quietly(distributed):
        dcp.save(state, storage_writer=writer, planner=BoxSavePlanner(), no_dist=not distributed,
                 process_group=process_group)
    return writer.written


def load(state: dict[str, Boxed], folder: Path, distributed: bool, metadata: Metadata | None = None,
         process_group=None) -> IndexedReader:
    """Collective: fill every box of `state` from the checkpoint in `folder` (its index
    `metadata`, when the caller has read it already: read once). Returns the reader: its
    `problem` (a box that failed its checksum on this rank: the caller decides collectively)
    and its `reads`."""
    reader = IndexedReader(folder, metadata)
    with _one_process_quietly(distributed):
        dcp.load(state, storage_reader=reader, planner=BoxLoadPlanner(), no_dist=not distributed,
                 process_group=process_group)
    return reader


@contextmanager
def collector_paused():
    """Python's cyclic collector off meanwhile. A save or load makes several small objects per
    box (DCP's items and ours), none in a cycle, and the collector's full passes walk every
    live object of the process (a model's thousands of tensors among them): with it a save of
    1,600 small layers took 8× one of 400, without it 4.5×."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


@contextmanager
def _one_process_quietly(distributed: bool):
    """DCP warns that it assumes one process when no group exists: here that is the intent.
    It logs two DEBUG records per tensor into a handler that drops them (a fifth of a save of
    thousands of small tensors): below WARNING its logger is off meanwhile."""
    logger = logging.getLogger(DCP_LOGGER)
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        with warnings.catch_warnings(), collector_paused():
            if not distributed:
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield
    finally:
        logger.setLevel(level)

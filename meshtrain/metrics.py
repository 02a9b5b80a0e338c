"""What every rank measures (its model-state bytes are counted by its holdings, in
`parallel.state`): the peak of its live activation bytes and its peak RSS; and what rank 0
writes: one JSON line per step and the loss curve."""

from __future__ import annotations

import json
import resource
import time
import weakref
from pathlib import Path

from meshtrain.atomic import atomic_write

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode


class ActivationMeter(TorchDispatchMode):
    """The peak of live activation bytes while it is entered (around a step's forward and
    backward passes): every storage an operator freshly allocates counts from its
    allocation until it is freed (a weak reference to the storage, whose callback uncounts
    it). Parameters, gradient buffers and inputs exist before and are never fresh
    allocations; views and in-place results share a storage and are not counted again.

    Unlike `saved_tensors_hooks`, this sees inside activation checkpointing, counts the
    temporaries of backward, and sees storages die, so several micro-batches in flight (a
    pipeline) give their true peak. It costs Python time per operator: enter it on a
    measured step, not on every step."""

    def __init__(self):
        super().__init__()
        self.peak = 0
        self._live = 0
        self._count = 0  # storages counted so far: a storage's number orders its allocation
        self._tracked: dict[int, _Held] = {}  # id of a live counted storage -> its reference

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        try:
            rule = _RULES[func]
        except KeyError:
            rule = _rule_of(func)
        if rule is None:  # no fresh result: a view, an in-place op
            return out
        fresh, check_inputs = rule
        inputs = None
        for is_fresh, value in zip(fresh, out if isinstance(out, tuple) else (out,)):
            if not is_fresh:
                continue
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(t, torch.Tensor) and not t.is_meta:  # a meta tensor: a shape without memory
                    if check_inputs:
                        inputs = _storages(args, kwargs) if inputs is None else inputs
                        if _storage_key(t) in inputs:
                            continue
                    self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        # A storage already counted is not counted again (a buffer noted twice, an operator's
        # result on a counted storage). PyTorch keeps a storage's Python object alive as long
        # as the storage, so its id names it until the reference's callback runs.
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._tracked:
            return
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        held = _Held(storage, self._free)
        held.key, held.number, held.nbytes = key, self._count, nbytes
        self._tracked[key] = held
        self._count += 1
        self._live += nbytes
        if self._live > self.peak:
            self.peak = self._live

    def _free(self, held: "_Held") -> None:
        del self._tracked[held.key]
        self._live -= held.nbytes

    @property
    def live(self) -> int:
        """Bytes of the storages allocated inside the meter that are alive now."""
        return self._live

    @property
    def count(self) -> int:
        """How many storages have been counted: a mark for `live_since`."""
        return self._count

    def live_since(self, mark: int) -> int:
        """Bytes alive now of the storages counted after `mark` (= `count` at some moment)."""
        return sum(held.nbytes for held in self._tracked.values() if held.number >= mark)


_BUILD_METERS: list["BuildMeter"] = []  # entered build meters, which also hear of buffers made outside modes


class BuildMeter(ActivationMeter):
    """The peak of every byte a rank allocates while it builds its part of the model: what
    operators allocate, and the buffers strategies allocate outside dispatch modes (ZeRO's,
    `note_buffer`), which the activation meter must not see."""

    def __enter__(self):
        _BUILD_METERS.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _BUILD_METERS.remove(self)
        return super().__exit__(*exc)


def note_buffer(t: torch.Tensor) -> torch.Tensor:
    """Count a buffer allocated outside dispatch modes in any build meter that is entered."""
    if not t.is_meta:
        for meter in _BUILD_METERS:
            meter._track(t)
    return t


def _storage_key(t: torch.Tensor):
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without a plain storage
        return None


class _Held(weakref.ref):
    """A counted storage: a weak reference (cheaper than `weakref.finalize`, which the meters
    would pay on every allocation) whose callback uncounts it when the storage is freed."""
    __slots__ = ("key", "number", "nbytes")


_RULES: dict = {}  # an operator -> None, or (whether each result is fresh, whether to check its inputs)
_VIEWS_DECLARED_FRESH = {torch.ops.aten._unsafe_view.default}


def _rule_of(func):
    """What the meters do with `func`'s results, read once per operator from its schema (they
    see thousands of calls of each): nothing when no result is fresh (no alias of an input);
    else count the fresh ones, after checking they are not on an input's storage where the
    schema cannot be trusted. ATen's schemas can, but `_unsafe_view`'s, which declares a fresh
    result that is a view of its input (for autograd's sake): its results are never counted.
    Collectives (c10d's in-place ops) return their inputs without saying so, and so may any
    other namespace's operators: their results are checked."""
    fresh = tuple(ret.alias_info is None for ret in func._schema.returns)
    if func in _VIEWS_DECLARED_FRESH:
        fresh = (False,) * len(fresh)
    rule = _RULES[func] = (fresh, func.namespace != "aten") if any(fresh) else None
    return rule


def _storages(args, kwargs) -> set:
    """The storages of an operator's tensor arguments (a schema nests them in lists at most)."""
    keys = set()
    for a in (*args, *(kwargs or {}).values()):
        for t in _tensors_in(a):
            key = _storage_key(t)
            if key is not None:
                keys.add(key)
    return keys


def _tensors_in(a):
    if isinstance(a, torch.Tensor):
        yield a
    elif isinstance(a, (list, tuple)):
        for x in a:
            yield from _tensors_in(x)


class LayerProbe:
    """What one block's forward leaves alive (its saved activations and its output, which is
    the next block's input): the per-layer figure of the activation-memory formulas, read
    under the meter at block 0's first forward (the first micro-batch).

    Only storages allocated inside the block count: one allocated before and freed during it
    (the embedding's partial sum, which gloo's worker thread may still hold at the block's
    start) changes nothing. At the block's end the reading is repeated until it stops
    changing: a tensor the block already let go of may still be held for a moment by the
    thread that finished its collective."""

    SETTLE_S, PATIENCE_S = 0.002, 0.2

    def __init__(self, module: nn.Module, meter: ActivationMeter):
        blocks = getattr(module, "blocks", None)  # a GPT's, or a pipeline stage's
        if blocks is None:
            blocks = getattr(module, "layers", None)  # the Llama's
        self.bytes, self._mark, self._hooks, self._meter = None, None, [], meter
        first = next(iter(blocks), None) if blocks is not None else None  # a pipeline stage's first block
        if first is not None:
            self._hooks = [first.register_forward_pre_hook(self._enter), first.register_forward_hook(self._leave)]

    def _enter(self, *_) -> None:  # hooks return None: a value would replace the module's data
        if self._mark is None:
            self._mark = self._meter.count

    def _leave(self, *_) -> None:
        if self.bytes is not None or self._mark is None:
            return
        reading, waited = self._meter.live_since(self._mark), 0.0
        while waited < self.PATIENCE_S:
            time.sleep(self.SETTLE_S)
            waited += self.SETTLE_S
            again = self._meter.live_since(self._mark)
            if again == reading:
                break
            reading = again
        self.bytes = reading

    def close(self) -> int | None:
        for h in self._hooks:
            h.remove()
        return self.bytes


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def peak_device_mib(device) -> float | None:
    """The most this process's CUDA allocator held on `device` (None off CUDA)."""
    import torch
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


class StepLog:
    """Appends one JSON object per step to OUT/metrics.jsonl, flushed as it goes. Nothing is
    written until `start`, which the loop calls once a resume has been accepted: a refused
    resume leaves the log as it was."""

    def __init__(self, path: Path, append: bool = False):
        self.path, self.append = path, append  # append: every attempt's lines kept (a replica group's log)
        self._file = None

    def start(self, step: int) -> None:
        """The run trains from after `step` (0 for a fresh run): the records up to it are kept
        (a resumed run's), the rest dropped, in one atomic replacement of the file."""
        if self.append:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a")
            return
        kept = [line for line in _lines(self.path) if json.loads(line).get("step", 0) <= step] if step else []
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(self.path, lambda tmp: tmp.write_text("".join(line + "\n" for line in kept)))
        self._file = open(self.path, "a")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def read_log(path: Path) -> list[dict]:
    """The records of a metrics.jsonl (those of a resumed run's earlier attempts included)."""
    return [json.loads(line) for line in _lines(path)]


def plot_losses(steps: list[int], losses: list[float], path: Path, title: str, *,
                val_losses: list[tuple[int, float]] = ()) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, losses, label="training")
    if val_losses:
        ax.plot(*zip(*val_losses), "o-", label="held-out")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def available_host_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None

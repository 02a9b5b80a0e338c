"""A parallelized model's state as a sharded, layout-independent checkpoint: every rank
records what it holds of each tensor, by the one-process name and full shape, as boxes
(`boxes.py`), and on load fills what it holds from whichever saved boxes overlap it, so a
checkpoint written in one layout loads in any other.

Tensors (`dcp.py`): `model/NAME` (the weights the optimizer steps: fp32 masters under
mixed precision; the low-precision copy is derived), `optim/NAME/KEY` (the optimizer state
by parameter name, not index: pipeline stages' groups would collide), `buffer/NAME`. The
rest is JSON (`state.json`, written by rank 0): the step (batches are a pure function of
seed and step, so the step is the data position), the optimizer's hyper-parameters, the
scheduler, each rank's random-number state, and what the caller adds (the run's identity)."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import torch

from meshtrain.checkpoint import dcp, folders
from meshtrain.checkpoint.boxes import Box, boxes
from meshtrain.checkpoint.dcp import Boxed

STATE = "state.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used here (another model, a bad folder): one line."""


def _model(name: str) -> str:
    return f"model/{name}"


def _optim(name: str, key) -> str:
    return f"optim/{name}/{key}"


def _whole(t: torch.Tensor) -> list[Box]:
    return [Box((0,) * t.dim(), tuple(t.shape), t)]


def _add(state: dict[str, Boxed], fqn: str, shape, dtype, found: list[Box]) -> None:
    entry = state.setdefault(fqn, Boxed(tuple(shape), dtype, []))
    entry.boxes += found


def saved_state(parallel) -> dict[str, Boxed]:
    """What this rank writes: its boxes of every weight, optimizer state and buffer."""
    state: dict[str, Boxed] = {}
    for h in parallel.holdings.checkpointed():
        _add(state, _model(h.name), h.shape, h.tensor.dtype, boxes(h.tensor, h.where, h.shape))
        for key, v in parallel.optimizer.state.get(h.tensor, {}).items():
            if not torch.is_tensor(v):
                continue
            if v.dim() > 0 and v.shape == h.tensor.shape:  # per element: placed as its parameter
                _add(state, _optim(h.name, key), h.shape, v.dtype, boxes(v, h.where, h.shape))
            else:  # Adam's step counter: whole, the same on every rank that holds a piece
                _add(state, _optim(h.name, key), v.shape, v.dtype, _whole(v))
    for name, b in persistent_buffers(parallel.module):
        _add(state, f"buffer/{name}", b.shape, b.dtype, _whole(b))
    return state


def persistent_buffers(module) -> list[tuple[str, torch.Tensor]]:
    """The buffers a state dict holds (not those a module marks non-persistent, such as a
    cache it recomputes)."""
    kept = set(module.state_dict(keep_vars=True))
    return [(n, b) for n, b in module.named_buffers() if n in kept]


def save(parallel, folder: Path, meta: dict) -> dict[str, dict]:
    """Collective: write this layout's state into `folder` (an empty folder; `folders.write`
    makes it atomic); returns the description of each file this rank wrote. `meta`:
    JSON-able facts of the run, rank 0's."""
    comm = parallel.comm
    rng = comm.all_gather_object(_rng_state())
    written = dcp.save(saved_state(parallel), folder, distributed=comm.mesh.world_size > 1)
    if comm.mesh.is_main:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in parallel.optimizer.param_groups]
        body = {**meta, "param_groups": groups, "rng": rng, "world_size": comm.mesh.world_size}
        try:
            text = json.dumps(body, indent=1)
        except TypeError as e:
            raise TypeError(f"checkpoint: the optimizer's, scheduler's or run's state is not plain data ({e})") from None
        written[STATE] = folders.write_synced(Path(folder) / STATE, text.encode())
    return written


def read_meta(folder: Path) -> dict:
    return json.loads((Path(folder) / STATE).read_text())


def load(parallel, folder: Path) -> dict:
    """Collective: fill this rank's weights, optimizer state and buffers from the checkpoint
    in `folder` (any layout's), reading only the saved boxes that overlap them; returns its
    `state.json`. Refuses (`CheckpointError`, on every rank alike) another model's."""
    comm, folder = parallel.comm, Path(folder)
    metadata = dcp.read_index(folder).state_dict_metadata
    restored = parallel.holdings.restored()
    _check_same_model(parallel, metadata, restored, folder)
    state: dict[str, Boxed] = {}
    for h in restored:
        _add(state, _model(h.name), h.shape, h.tensor.dtype, boxes(h.tensor, h.where, h.shape))
    for name, b in persistent_buffers(parallel.module):
        _add(state, f"buffer/{name}", b.shape, b.dtype, _whole(b))
    optimizer_state = {}
    for h in parallel.holdings.checkpointed():
        optimizer_state[h.tensor] = _optimizer_targets(h, metadata, parallel.optimizer.state.get(h.tensor, {}), state)
    dcp.load(state, folder, distributed=comm.mesh.world_size > 1)
    for t, entry in optimizer_state.items():
        parallel.optimizer.state.pop(t, None)
        if entry:
            parallel.optimizer.state[t] = entry
    meta = read_meta(folder)
    if meta.get("world_size") == comm.mesh.world_size and meta.get("layout") == _layout_of(parallel):
        _set_rng_state(meta["rng"][comm.mesh.rank])  # the same ranks: each its own random state
    for group, saved in zip(parallel.optimizer.param_groups, meta.get("param_groups", [])):
        group.update({k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in saved.items()})
    return meta


def _optimizer_targets(h, metadata, existing: dict, state: dict[str, Boxed]) -> dict:
    """The optimizer state of one held tensor, ready to be read into (the tensors it has,
    or new ones shaped as the checkpoint's keys say), its boxes added to `state`."""
    prefix = _optim(h.name, "")
    entry = {}
    for fqn, md in metadata.items():
        if not fqn.startswith(prefix) or "/" in fqn[len(prefix):]:
            continue
        key = fqn[len(prefix):]
        key = int(key) if key.isdigit() else key
        dtype, old = md.properties.dtype, existing.get(key)
        if tuple(md.size) == tuple(h.shape) and len(h.shape) > 0:
            t = old if torch.is_tensor(old) and old.shape == h.tensor.shape and old.dtype == dtype else \
                torch.zeros(h.tensor.shape, dtype=dtype, device=h.tensor.device)
            _add(state, fqn, md.size, dtype, boxes(t, h.where, h.shape))
        else:  # a counter: on the CPU, where torch's optimizers keep theirs
            t = old if torch.is_tensor(old) and tuple(old.shape) == tuple(md.size) and old.dtype == dtype else \
                torch.zeros(tuple(md.size), dtype=dtype)
            _add(state, fqn, md.size, dtype, _whole(t))
        entry[key] = t
    return entry


def _check_same_model(parallel, metadata, restored, folder: Path) -> None:
    """Collective: the checkpoint holds exactly this model's tensors, at its shapes."""
    mine = {h.name: tuple(h.shape) for h in restored}
    mine.update({name: tuple(b.shape) for name, b in persistent_buffers(parallel.module)})
    wanted: dict[str, tuple] = {}
    for part in parallel.comm.all_gather_object(mine):
        wanted.update(part)
    saved = {fqn.split("/", 1)[1]: tuple(md.size) for fqn, md in metadata.items()
             if fqn.startswith(("model/", "buffer/"))}
    missing = sorted(set(wanted) - set(saved))
    extra = sorted(set(saved) - set(wanted))
    wrong = sorted(n for n in set(wanted) & set(saved) if wanted[n] != saved[n])
    if missing or extra or wrong:
        what = (f"{wrong[0]} is {list(saved[wrong[0]])} there, {list(wanted[wrong[0]])} here" if wrong else
                f"it lacks {missing[0]}" if missing else f"it has {extra[0]}, which this model lacks")
        raise CheckpointError(f"{folder} holds another model's weights ({what}; {len(missing)} missing, "
                              f"{len(extra)} extra, {len(wrong)} of another shape)")


def _layout_of(parallel) -> dict:
    return dict(parallel.comm.mesh.sizes)


def _rng_state() -> dict:
    state = {"cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["cpu"])), dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["cuda"])), dtype=torch.uint8))


def save_checkpoint(parallel, final: Path, meta: dict, files=()) -> None:
    """Collective: `save` made atomic and verifiable (`folders.write`), with `files` copied
    in by rank 0."""
    meta = {**meta, "layout": _layout_of(parallel)}

    def write(tmp: Path) -> dict[str, dict]:
        written = save(parallel, tmp, meta)
        if parallel.comm.mesh.is_main:
            for f in files:  # described by reading (small)
                shutil.copyfile(f, tmp / Path(f).name)
        return written

    folders.write(Path(final), parallel.comm, write)


def load_checkpoint(parallel, folder: Path) -> dict:
    """Collective: `load` of a checkpoint checked good first (`folders.check`)."""
    problem = folders.check(Path(folder), parallel.comm)
    if problem is not None:
        raise CheckpointError(f"{folder}: {problem}")
    return load(parallel, folder)

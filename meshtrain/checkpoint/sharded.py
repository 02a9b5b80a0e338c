"""A parallelized model's state as a sharded, layout-independent checkpoint: every rank
records what it holds of each tensor, by the one-process name and full shape, as boxes
(`boxes.py`), and on load fills what it holds from whichever saved boxes overlap it, so a
checkpoint written in one layout loads in any other.

Tensors (`dcp.py`): `model/NAME` (the weights the optimizer steps: fp32 masters under
mixed precision; the low-precision copy is derived), `optim/NAME/KEY` (the optimizer state
by parameter name, not index: pipeline stages' groups would collide), `buffer/NAME`, and
`rng/RANK/DEVICE`, each rank's random-number state, written by that rank alone and read
back only by the same rank of the same layout (never gathered). The rest is JSON
(`state.json`, written by rank 0 from what every rank sends it): the step (batches are a
pure function of seed and step, so the step is the data position), the optimizer's
hyper-parameters by parameter name (each rank's groups hold other parameters), the
scheduler's state (each rank's where they differ), and what the caller adds (the run's
identity)."""

from __future__ import annotations

import base64
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from meshtrain.checkpoint import dcp, folders
from meshtrain.checkpoint.boxes import Box, boxes
from meshtrain.checkpoint.dcp import Boxed
from meshtrain.checkpoint.folders import CheckpointError, CorruptCheckpoint, decide, first_problem
from meshtrain.lowbit import readable_state
from meshtrain.parallel.state import persistent_buffers

STATE = "state.json"


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
        for key, v in readable_state(parallel.optimizer, h.tensor).items():
            if not torch.is_tensor(v):
                continue
            if v.dim() > 0 and v.shape == h.tensor.shape:  # per element: placed as its parameter
                _add(state, _optim(h.name, key), h.shape, v.dtype, boxes(v, h.where, h.shape))
            else:  # Adam's step counter: whole, the same on every rank that holds a piece
                _add(state, _optim(h.name, key), v.shape, v.dtype, _whole(v))
    for name, b in persistent_buffers(parallel.module):
        _add(state, f"buffer/{name}", b.shape, b.dtype, _whole(b))
    for fqn, t in _rng_states(parallel.comm.mesh.rank).items():
        _add(state, fqn, t.shape, t.dtype, _whole(t))
    return state


def _rng_states(rank: int) -> dict[str, torch.Tensor]:
    """This rank's random-number states as the tensors torch gives (copies), by entry name."""
    out = {f"rng/{rank}/cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out[f"rng/{rank}/cuda"] = torch.cuda.get_rng_state()
    return out



@dataclass
class Snapshot:
    """What a save writes, taken at one moment: this rank's boxes (views of its memory, or of
    a staged copy) and, on rank 0, the checkpoint's JSON facts."""
    state: dict[str, Boxed]
    body: dict | None


def snapshot(parallel, meta: dict, lr_scheduler=None) -> Snapshot:
    """Collective: this layout's state as a save writes it. `meta`: JSON-able facts of the
    run, rank 0's; `lr_scheduler`: the scheduler whose state every rank saves. What a rank
    reads of its own state is checked on every rank, and a failure there raises on every
    rank (`folders.decide`) before anything is written. Python's collector is paused meanwhile."""
    with dcp.collector_paused():
        return _snapshot(parallel, meta, lr_scheduler)


def _snapshot(parallel, meta: dict, lr_scheduler=None) -> Snapshot:
    """The body of `snapshot`."""
    comm = parallel.comm
    state, mine, error = None, None, None
    try:
        state = saved_state(parallel)
        scheduler = _plain(lr_scheduler.state_dict(), "the lr scheduler's state") if lr_scheduler is not None else None
        mine = {"groups": hyper_parameters(parallel), "lr_scheduler": scheduler}
        if comm.mesh.is_main:
            _plain(meta, "the facts saved beside the state")
    except Exception as e:
        error = e
    every = decide(comm, error, "saving a checkpoint", mine)
    body = None
    if comm.mesh.is_main:
        body = {**meta, "optimizer_groups": _by_name([part["groups"] for part in every]),
                **_schedulers([part["lr_scheduler"] for part in every]), "world_size": comm.mesh.world_size}
    return Snapshot(state, body)


def write_snapshot(snap: Snapshot, folder: Path, comm, files=(), process_group=None) -> dict[str, dict]:
    """Collective (over `process_group`, the default group when None): write `snap` into
    `folder` (an empty folder; `folders.write` makes it atomic), rank 0 its `state.json` and
    a copy of each of `files`; returns the description of each file this rank wrote."""
    written = dcp.save(snap.state, folder, distributed=comm.mesh.world_size > 1, process_group=process_group)
    if snap.body is not None:
        written[STATE] = folders.write_synced(Path(folder) / STATE, json.dumps(snap.body, indent=1).encode())
        for f in files:  # described by reading (small)
            shutil.copyfile(f, Path(folder) / Path(f).name)
    return written


def _numbers(value):
    """`value` with every one-element tensor as its number (torchao keeps learning rates as
    0-dim tensors, in its groups and so in a scheduler's state)."""
    if torch.is_tensor(value) and value.numel() == 1:
        return value.item()
    if isinstance(value, dict):
        return {k: _numbers(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_numbers(v) for v in value)
    return value


def _plain(value, what: str) -> str:
    """`value` as JSON text (sorted keys: equal values, equal texts; one-element tensors as
    numbers), or one line saying that it is not plain data."""
    try:
        return json.dumps(_numbers(value), sort_keys=True)
    except (TypeError, ValueError) as e:
        raise TypeError(f"checkpoint: {what}: not plain data ({e})") from None


def _names(parallel) -> dict[int, str]:
    """The parameter name of each tensor the optimizer steps on this rank, by id."""
    return {id(h.tensor): h.name for h in parallel.holdings.checkpointed()}


def hyper_parameters(parallel) -> list[tuple[str, list[str]]]:
    """This rank's optimizer groups: each one's hyper-parameters (all but its params) as JSON
    text, with the names of the parameters it steps here."""
    names, out = _names(parallel), []
    for i, group in enumerate(parallel.optimizer.param_groups):
        held = [names[id(p)] for p in group["params"] if id(p) in names]
        out.append((_plain({k: v for k, v in group.items() if k != "params"},
                           f"the hyper-parameters of optimizer group {i} ({held[0] if held else 'empty'})"), held))
    return out


def _by_name(parts: list[list[tuple[str, list[str]]]]) -> dict:
    """Every rank's groups as hyper-parameters by parameter name (the lowest rank's where
    ranks differ): {"hyper": [each distinct set], "of": {name: its index in "hyper"}}."""
    of: dict[str, str] = {}
    for part in parts:
        for text, held in part:
            for name in held:
                of.setdefault(name, text)
    distinct = sorted(set(of.values()))
    index = {text: i for i, text in enumerate(distinct)}
    return {"hyper": [json.loads(t) for t in distinct], "of": {name: index[t] for name, t in sorted(of.items())}}


def _schedulers(texts: list[str | None]) -> dict:
    """The scheduler's state: rank 0's, and every rank's where they differ."""
    out = {"lr_scheduler": json.loads(texts[0]) if texts[0] is not None else None}
    if len(set(texts)) > 1:
        out["lr_schedulers"] = [json.loads(t) if t is not None else None for t in texts]
    return out


def read_meta(folder: Path) -> dict:
    return json.loads((Path(folder) / STATE).read_text())


def load(parallel, folder: Path, reads: list | None = None) -> dict:
    """Collective: fill this rank's weights, optimizer state and buffers from the checkpoint
    in `folder` (any layout's), reading each saved box that overlaps them once (under ZeRO-1
    and 2 the weights only of its pieces: `read_on_load`); returns its `state.json`. Refuses
    (`CheckpointError`, on every rank alike) another model's, and (`CorruptCheckpoint`) one
    whose bytes read on any rank fail their checksum. `reads`: a list that gets the (file,
    offset, length) of each read of this rank. Python's collector is paused meanwhile
    (`dcp.collector_paused`)."""
    with dcp.collector_paused():
        return _load(parallel, folder, reads)


def _load(parallel, folder: Path, reads: list | None = None) -> dict:
    """The body of `load`."""
    comm, folder = parallel.comm, Path(folder)
    index = dcp.read_index(folder)
    metadata = index.state_dict_metadata
    restored = parallel.holdings.restored()
    _check_same_model(parallel, metadata, restored, folder)
    meta = read_meta(folder)
    groups, error = [], None
    try:
        groups = _groups_to_restore(parallel, meta, folder)
    except CheckpointError as e:
        error = e
    decide(comm, error, f"loading {folder}")  # refused on every rank before anything is read
    state: dict[str, Boxed] = {}
    for h in parallel.holdings.read_on_load():
        _add(state, _model(h.name), h.shape, h.tensor.dtype, boxes(h.tensor, h.where, h.shape))
    for name, b in persistent_buffers(parallel.module):
        _add(state, f"buffer/{name}", b.shape, b.dtype, _whole(b))
    optimizer_state, saved_keys = {}, _optimizer_keys(metadata)
    for h in parallel.holdings.checkpointed():
        optimizer_state[h.tensor] = _optimizer_targets(h, saved_keys.get(h.name, []),
                                                       parallel.optimizer.state.get(h.tensor, {}), state)
    same_ranks = _same_ranks(parallel, meta)
    rng = {fqn: torch.empty_like(t) for fqn, t in _rng_states(comm.mesh.rank).items() if fqn in metadata} \
        if same_ranks else {}
    for fqn, t in rng.items():
        _add(state, fqn, t.shape, t.dtype, _whole(t))
    reader = dcp.load(state, folder, distributed=comm.mesh.world_size > 1, metadata=index)
    if reads is not None:
        reads += reader.reads
    problem = first_problem(comm, reader.problem)
    if problem is not None:  # on every rank alike: the caller may try an older checkpoint
        raise CorruptCheckpoint(f"{folder}: {problem}")
    parallel.holdings.finish_load()
    for t, entry in optimizer_state.items():
        parallel.optimizer.state.pop(t, None)
        if entry:
            parallel.optimizer.state[t] = entry
    if same_ranks:  # the same ranks: each its own random state
        _set_rng_state(_rng_from(rng) if rng else _decoded(meta["rng"][comm.mesh.rank]))
    for group, saved in groups:
        group.update({k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in saved.items()})
    return meta


def _same_ranks(parallel, meta: dict) -> bool:
    """Whether the checkpoint was written by these ranks: the same world size and layout."""
    return meta.get("world_size") == parallel.comm.mesh.world_size and meta.get("layout") == _layout_of(parallel)


def _groups_to_restore(parallel, meta: dict, folder: Path) -> list[tuple[dict, dict]]:
    """Each of this rank's optimizer groups with the hyper-parameters saved for the names of
    its parameters; refuses (one line) a group whose parameters were saved with different
    ones. A checkpoint of an earlier meshtrain holds rank 0's groups, applied by position."""
    groups = parallel.optimizer.param_groups
    saved = meta.get("optimizer_groups")
    if saved is None:
        return list(zip(groups, meta.get("param_groups", [])))
    names, out = _names(parallel), []
    for i, group in enumerate(groups):
        held = sorted(names[id(p)] for p in group["params"] if names.get(id(p)) in saved["of"])
        found = {saved["of"][name]: name for name in reversed(held)}  # each set's first name
        if len(found) > 1:
            (a, x), (b, y) = sorted(found.items(), key=lambda kv: kv[1])[:2]
            ha, hb = saved["hyper"][a], saved["hyper"][b]
            diff = ", ".join(f"{k} {ha.get(k)} and {hb.get(k)}" for k in sorted(set(ha) | set(hb))
                             if ha.get(k) != hb.get(k))
            raise CheckpointError(f"{folder}: this rank's optimizer group {i} holds {x} and {y}, saved with different "
                                  f"hyper-parameters ({diff}); build the optimizer with the groups of the run that "
                                  f"saved it")
        if found:
            out.append((group, saved["hyper"][next(iter(found))]))
    return out


def lr_scheduler_state(parallel, meta: dict) -> dict | None:
    """The scheduler's state this rank restores: its own when these are the ranks that saved
    it (`_same_ranks`); else the saved one (rank 0's) with its per-group lists re-derived from
    this rank's groups as restored (`base_lrs` from their `initial_lr`, `_last_lr` from their
    `lr`), since another layout's ranks hold other groups."""
    every = meta.get("lr_schedulers")
    if _same_ranks(parallel, meta):
        return every[parallel.comm.mesh.rank] if every is not None else meta.get("lr_scheduler")
    state = meta.get("lr_scheduler")
    if state is None:
        return None
    groups = parallel.optimizer.param_groups
    state = dict(state)
    if "base_lrs" in state:
        state["base_lrs"] = [g.get("initial_lr", g["lr"]) for g in groups]
    if "_last_lr" in state:
        state["_last_lr"] = [g["lr"] for g in groups]
    return state


def _optimizer_keys(metadata) -> dict[str, list[tuple[object, str, object]]]:
    """The saved optimizer state by parameter name: [(key, fqn, metadata)], in one pass over
    the index (looked up per tensor, so a load stays linear in the number of tensors)."""
    out: dict[str, list] = {}
    for fqn, md in metadata.items():
        if fqn.startswith("optim/"):
            name, _, key = fqn[len("optim/"):].rpartition("/")
            out.setdefault(name, []).append((int(key) if key.isdigit() else key, fqn, md))
    return out


def _optimizer_targets(h, saved: list[tuple[object, str, object]], existing: dict, state: dict[str, Boxed]) -> dict:
    """The optimizer state of one held tensor, ready to be read into (the tensors it has,
    or new ones shaped as the checkpoint's keys `saved` say), its boxes added to `state`."""
    entry = {}
    for key, fqn, md in saved:
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
    """Collective: the checkpoint holds exactly this model's tensors, at its shapes. Every rank
    reads the same index, so each checks its own tensors against it and marks the saved ones
    it holds; one all-reduce of a number per saved tensor and one flag (`Comm.any_ranks`)
    gives every rank the verdict: a size that does not grow with the world. Only a refusal
    gathers the ranks' names to rank 0, which words it (`_another_model`) and broadcasts it."""
    comm = parallel.comm
    mine = {h.name: tuple(h.shape) for h in restored}
    mine.update({name: tuple(b.shape) for name, b in persistent_buffers(parallel.module)})
    saved = {fqn.split("/", 1)[1]: tuple(md.size) for fqn, md in metadata.items()
             if fqn.startswith(("model/", "buffer/"))}
    *held, differs = comm.any_ranks([name in mine for name in sorted(saved)]
                                    + [any(saved.get(name) != shape for name, shape in mine.items())])
    if all(held) and not differs:
        return
    every = comm.gather_object(mine)
    raise CheckpointError(comm.broadcast_object(None if every is None else _another_model(every, saved, folder)))


def _another_model(every: list[dict[str, tuple]], saved: dict[str, tuple], folder: Path) -> str:
    """The one line refusing a checkpoint whose tensors (`saved`: name -> shape) are not
    those every rank holds (`every`: each rank's), naming the first name that differs."""
    wanted: dict[str, tuple] = {}
    for part in every:
        for name, shape in part.items():
            if wanted.get(name, saved.get(name)) == saved.get(name):  # a shape that differs is kept
                wanted[name] = shape
    missing = sorted(set(wanted) - set(saved))
    extra = sorted(set(saved) - set(wanted))
    wrong = sorted(n for n in set(wanted) & set(saved) if wanted[n] != saved[n])
    what = (f"{wrong[0]} is {list(saved[wrong[0]])} there, {list(wanted[wrong[0]])} here" if wrong else
            f"it lacks {missing[0]}" if missing else f"it has {extra[0]}, which this model lacks")
    return (f"{folder} holds another model's weights ({what}; {len(missing)} missing, "
            f"{len(extra)} extra, {len(wrong)} of another shape)")


def _layout_of(parallel) -> dict:
    return dict(parallel.comm.mesh.sizes)


def _rng_from(read: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{device: state} of the `rng/RANK/DEVICE` entries read."""
    return {fqn.rsplit("/", 1)[1]: t for fqn, t in read.items()}


def _decoded(saved: dict) -> dict[str, torch.Tensor]:
    """A checkpoint of an earlier meshtrain: every rank's states in state.json, base64."""
    return {device: torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
            for device, text in saved.items()}


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(parallel, final: Path, meta: dict, files=(), lr_scheduler=None, saver=None, then=None) -> None:
    """Collective: `snapshot`, written atomically and verifiably (`folders.write`), with
    `files` copied in by rank 0, then `then(comm)` (a prune). A failure on any rank raises
    on every rank. `saver`: a `background.BackgroundSaver` that stages the snapshot and writes
    it in a thread (this returns once it is staged)."""
    snap = snapshot(parallel, {**meta, "layout": _layout_of(parallel)}, lr_scheduler)
    if saver is not None:
        saver.save(snap, Path(final), files, then)
        return
    folders.write(Path(final), parallel.comm, lambda tmp: write_snapshot(snap, tmp, parallel.comm, files))
    if then is not None:
        then(parallel.comm)


def load_checkpoint(parallel, folder: Path) -> dict:
    """Collective: `load` of a checkpoint checked good first (`folders.check`)."""
    problem = folders.check(Path(folder), parallel.comm)
    if problem is not None:
        raise CheckpointError(f"{folder}: {problem}")
    return load(parallel, folder)

"""What a replica group that joins takes from a live one (`meshtrain.replicas`), rank by rank:
the same group rank of the same layout holds the same tensors, so the state is a list by
position, not a checkpoint by name. Everything this rank holds travels — the parameters (and
their fp32 masters), the optimizer's state and hyper-parameters, persistent buffers, the
scheduler, the step and the random state — so that a healed rank equals its peer bit for bit
and nothing is rebuilt by a collective (a heal that failed on one rank of a group must not
leave the others waiting in one)."""

from __future__ import annotations

import hashlib
import os

import torch

from meshtrain.parallel.state import persistent_buffers


def attach_replicas(job, options) -> None:
    """Make `job` one of `options.replicas` replica groups (`meshtrain.replicas`): its torchft
    manager, with this module's state registered for healing a joining group."""
    from meshtrain.replicas import ReplicaGroups
    mesh = job.mesh
    groups = ReplicaGroups(options, mesh.device, mesh.rank, mesh.world_size, job.parallel.comm.broadcast_object)
    groups.register_state(lambda: replica_state(job), lambda state: load_replica_state(job, state))
    job.replicas = groups


def _tensors(job) -> list[torch.Tensor]:
    """This rank's weights (every copy it keeps: ZeRO's full parameters and their masters)
    and persistent buffers, in a fixed order."""
    p = job.parallel
    seen: dict[int, torch.Tensor] = {}
    for h in p.holdings.restored():
        seen.setdefault(id(h.tensor), h.tensor)
    for _, b in persistent_buffers(p.module):
        seen.setdefault(id(b), b)
    return list(seen.values())


def replica_state(job) -> dict:
    """This rank's state, by position (references, not copies: torchft sends it while this
    group waits for its quorum, and nothing changes it before the next commit)."""
    p = job.parallel
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()
    return {"tensors": _tensors(job),
            "optim": [dict(p.optimizer.state.get(h.tensor, {})) for h in p.holdings.checkpointed()],
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in p.optimizer.param_groups],
            "steps": job.steps, "rng": rng,
            "lr_scheduler": job.lr_scheduler.state_dict() if job.lr_scheduler is not None else None}


def load_replica_state(job, state: dict) -> None:
    """A live peer's `replica_state`, into this rank's tensors in place."""
    p = job.parallel
    mine = _tensors(job)
    theirs = state["tensors"]
    shapes = [tuple(t.shape) for t in mine], [tuple(t.shape) for t in theirs]
    if shapes[0] != shapes[1]:
        raise RuntimeError("a replica group's peer holds other tensors than this rank (another layout or model): "
                           "every group must run the same flags")
    with torch.no_grad():
        for dst, src in zip(mine, theirs):
            dst.copy_(src)
        for h, saved in zip(p.holdings.checkpointed(), state["optim"]):
            now = p.optimizer.state.get(h.tensor, {})
            fresh = {}
            for key, value in saved.items():
                if torch.is_tensor(value):
                    held = now.get(key)
                    value = held.copy_(value) if torch.is_tensor(held) and held.shape == value.shape \
                        else value.to(h.tensor.device if value.dim() > 0 else value.device)
                fresh[key] = value
            p.optimizer.state.pop(h.tensor, None)
            if fresh:
                p.optimizer.state[h.tensor] = fresh
    for group, saved in zip(p.optimizer.param_groups, state["groups"]):
        group.update(saved)
    job.steps = state["steps"]
    if job.lr_scheduler is not None and state["lr_scheduler"] is not None:
        job.lr_scheduler.load_state_dict(state["lr_scheduler"])
    torch.set_rng_state(state["rng"]["cpu"])
    if "cuda" in state["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["rng"]["cuda"])


DIGESTS_ENV = "MESHTRAIN_FT_DIGESTS"  # tests: each committed step's log line carries `replica_digest`


def replica_digest(job) -> str:
    """A digest of everything `replica_state` sends of this rank (weights, optimizer state):
    equal on the same rank of two groups exactly when their states are equal bit for bit."""
    h = hashlib.sha256()
    state = replica_state(job)
    for t in [*state["tensors"], *(v for entry in state["optim"] for _, v in sorted(entry.items())
                                     if torch.is_tensor(v))]:
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def digests_wanted() -> bool:
    return bool(os.environ.get(DIGESTS_ENV))

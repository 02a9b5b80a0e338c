"""Faults injected on purpose, for the tests of restarts and preemption: the environment
variable MESHTRAIN_FAULT=KIND:RANK:STEP makes rank RANK, in the first attempt of a job only
(not after a restart), at step STEP:
- `kill`: die by SIGKILL at the end of the step (before its checkpoint);
- `kill-in-save`: die by SIGKILL inside the checkpoint of that step, its files written but
  not its marker;
- `term`: receive SIGTERM during the step, before its update (a scheduler's preemption);
- `kill-in-allreduce`: die by SIGKILL inside the step's gradient all-reduce over replica
  groups (`--ft-replicas`), after its first bucket.
A fourth field, KIND:RANK:STEP:GROUP, names the replica group too (`FT_REPLICA_ENV`, which
meshtrain's launcher of replica groups sets). Nothing happens when the variable is unset."""

from __future__ import annotations

import os
import signal

FAULT_ENV = "MESHTRAIN_FAULT"
RESTART_ENV = "MESHTRAIN_RESTART"  # set by meshtrain's own launcher on its k-th restart
FT_REPLICA_ENV = "MESHTRAIN_FT_REPLICA"  # a replica group's index, set by meshtrain's launcher of the groups
KINDS = {"kill": signal.SIGKILL, "kill-in-save": signal.SIGKILL, "term": signal.SIGTERM,
         "kill-in-allreduce": signal.SIGKILL}


def restart_count(environ=os.environ) -> int:
    """How many times this job's workers were restarted: by meshtrain's launcher
    (`--max-restarts`) or by an outside torchrun's (its `--max-restarts`)."""
    return max(int(environ.get(RESTART_ENV, 0) or 0), int(environ.get("TORCHELASTIC_RESTART_COUNT", 0) or 0))


def due(kind: str, rank: int, step: int | None) -> bool:
    """Whether the configured fault is `kind`'s, for this rank and step (and replica group)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec or step is None or restart_count() > 0:
        return False
    want, want_rank, want_step, *group = spec.split(":")
    if group and group[0] != os.environ.get(FT_REPLICA_ENV):
        return False
    return want == kind and int(want_rank) == rank and int(want_step) == step


def inject(kind: str, rank: int, step: int | None) -> None:
    """Raise the configured fault if it is `kind`'s, for this rank and step."""
    if due(kind, rank, step):
        os.kill(os.getpid(), KINDS[kind])

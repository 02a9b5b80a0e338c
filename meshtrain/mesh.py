"""The device mesh: every rank's coordinates on the named axes (pp, dp, tp) and one process
group per axis. tp is innermost (adjacent ranks share the fastest links), pp outermost.
Strategies ask the mesh for their group and size; none computes ranks by hand."""

from __future__ import annotations

from itertools import product

AXES = ("pp", "dp", "tp")


class Mesh:
    def __init__(self, sizes: dict[str, int], device, device_mesh=None):
        self.sizes = {axis: int(sizes.get(axis, 1)) for axis in AXES}
        self.device = device
        self._dm = device_mesh  # torch DeviceMesh; None for the one-process mesh
        # Rank and coordinates are read once, so they stay valid after the group is gone.
        self.rank = device_mesh.get_rank() if device_mesh is not None else 0
        coord = device_mesh.get_coordinate() if device_mesh is not None else (0,) * len(AXES)
        self._coord = dict(zip(AXES, coord))
        # Global rank at every coordinate, read once (for point-to-point peers).
        self._ranks = device_mesh.mesh.tolist() if device_mesh is not None else [[[0]]]
        self._channels: dict[tuple[str, str], object] = {}  # (axis, name) -> a second group along the axis
        self.seed = 0  # what `meshtrain.init` was given: dropout masks and drawn weights follow it
        self._comm = None

    @classmethod
    def build(cls, pp: int, dp: int, tp: int, device) -> "Mesh":
        """Collective: every rank of the default process group must call it."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        world = dist.get_world_size()
        if world != pp * dp * tp:
            raise ValueError(f"world size {world} != pp×dp×tp = {pp}×{dp}×{tp}")
        dm = init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=AXES)
        return cls({"pp": pp, "dp": dp, "tp": tp}, device, dm)

    @classmethod
    def single(cls, device) -> "Mesh":
        """One process, every axis of size 1: the reference run; needs no process group."""
        return cls({}, device)

    @property
    def world_size(self) -> int:
        return self.sizes["pp"] * self.sizes["dp"] * self.sizes["tp"]

    def size(self, axis: str) -> int:
        return self.sizes[axis]

    def coord(self, axis: str) -> int:
        return self._coord[axis]

    def coords(self) -> dict[str, int]:
        return {axis: self.coord(axis) for axis in AXES}

    def rank_at(self, axis: str, coord: int) -> int:
        """The global rank that shares this rank's other coordinates and sits at `coord` on `axis`."""
        if not 0 <= coord < self.size(axis):
            raise ValueError(f"coordinate {coord} is outside the {axis} axis of size {self.size(axis)}")
        return self._global(dict(self._coord, **{axis: coord}))

    def neighbour(self, axis: str, offset: int, *, wrap: bool = False) -> int | None:
        """The global rank `offset` steps along `axis` (the next pipeline stage is
        `neighbour("pp", +1)`); None past either end unless `wrap`."""
        coord = self.coord(axis) + offset
        if wrap:
            coord %= self.size(axis)
        return self.rank_at(axis, coord) if 0 <= coord < self.size(axis) else None

    def axis_ranks(self, axis: str) -> list[list[int]]:
        """The global ranks of every group along `axis`, each in coordinate order."""
        others = [a for a in AXES if a != axis]
        return [[self._global({**dict(zip(others, at)), axis: c}) for c in range(self.size(axis))]
                for at in product(*(range(self.size(a)) for a in others))]

    def _global(self, at: dict[str, int]) -> int:
        return self._ranks[at["pp"]][at["dp"]][at["tp"]]

    def open_channel(self, axis: str, name: str, backend: str | None = None) -> None:
        """Collective over the whole world: a second process group along `axis`, `name`d
        (`group(axis, name)`), apart from the axis's own. Collectives on one group must be
        issued in the same order on every rank; two kinds of traffic whose order relative to
        each other may differ between ranks each need a group of their own. `backend`: the
        default group's when None."""
        import torch.distributed as dist

        if (axis, name) not in self._channels:
            mine, _ = dist.new_subgroups_by_enumeration(self.axis_ranks(axis), backend=backend)
            self._channels[(axis, name)] = mine

    def groups(self) -> list:
        """Every process group this rank belongs to but the world's: each axis's of more
        than one rank, and the channels."""
        axes = [self.group(axis) for axis in AXES if self.size(axis) > 1 and self._dm is not None]
        return axes + list(self._channels.values())

    def device_mesh(self, axis: str):
        """torch's one-dimensional DeviceMesh along `axis` (for PyTorch-native peers: DTensor)."""
        if self._dm is None:
            raise ValueError("the one-process mesh has no DeviceMesh")
        return self._dm[axis]

    def group(self, axis: str, channel: str | None = None):
        """The process group of this rank along `axis` (None on the one-process mesh), or
        the channel `open_channel` made."""
        if channel is not None:
            return self._channels[(axis, channel)]
        return self._dm.get_group(axis) if self._dm is not None else None

    @property
    def comm(self):
        """This mesh's `Comm` (every collective, bytes counted per axis), made once."""
        if self._comm is None:
            from meshtrain.comm import Comm
            self._comm = Comm(self)
        return self._comm

    def attach(self, comm, seed: int | None = None) -> None:
        """Use `comm` (made by the caller, whose byte counts it reads) as this mesh's `comm`."""
        self._comm = comm
        if seed is not None:
            self.seed = seed

    def rows(self, batch_size: int) -> slice:
        """The rows of a global batch of `batch_size` samples that this rank's data-parallel
        replica trains on (contiguous, in dp coordinate order): what `job.step(...,
        rows="local")` expects this rank to pass."""
        n = self.size("dp")
        if batch_size % n:
            raise ValueError(f"a batch of {batch_size} rows does not split over dp={n}; use a multiple of {n}")
        local = batch_size // n
        return slice(self.coord("dp") * local, (self.coord("dp") + 1) * local)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def __repr__(self) -> str:
        return f"Mesh(pp={self.sizes['pp']}, dp={self.sizes['dp']}, tp={self.sizes['tp']}, rank={self.rank})"

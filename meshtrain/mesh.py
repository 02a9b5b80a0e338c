"""The device mesh: every rank's coordinates on the named axes (pp, dp, cp, tp) and one
process group per axis. tp is innermost (adjacent ranks share the fastest links), pp
outermost. Strategies ask the mesh for their group and size; none computes ranks by hand.

Context parallelism (cp) splits every sequence over its ranks, which hold the same
parameters: for the parameters a cp rank is one more replica. So the `dp` axis the
strategies see (gradient buckets, ZeRO's shards, the loss's and the norm's sums) is the
flattened dp × cp (torchtitan's dp_shard_cp), dp-major; the data's rows are split over the
batch's dp alone (`rows`, `batch_dp`), and `cp` is the ring that attention's keys and
values travel.

Expert parallelism (ep) adds no ranks: it folds over the dp × cp × tp ranks of a pipeline
stage (torchtitan's folding, expert-TP 1). Numbered f = (dp·cp coordinate)·tp + tp
coordinate (tp innermost), the ranks f // ep alike form an `ep` group that holds one full
set of experts between them (coordinate f mod ep: the experts' ep-th chunk), and the ranks
f mod ep alike an `edp` group (coordinate f // ep), the replicas of one chunk of experts,
over which its gradients are summed and ZeRO shards it."""

from __future__ import annotations

from itertools import product

AXES = ("pp", "dp", "tp")  # what the strategies see: dp is the parameters' replicas, dp × cp
MESH_AXES = ("pp", "dp", "cp", "tp")  # the DeviceMesh's dimensions


class Mesh:
    def __init__(self, sizes: dict[str, int], device, device_mesh=None):
        self.batch_dp, self.cp = int(sizes.get("dp", 1)), int(sizes.get("cp", 1))
        self.sizes = {"pp": int(sizes.get("pp", 1)), "dp": self.batch_dp * self.cp, "tp": int(sizes.get("tp", 1)),
                      "cp": self.cp}
        ep, fold = int(sizes.get("ep", 1)), self.sizes["dp"] * self.sizes["tp"]
        if fold % ep:
            raise ValueError(f"ep={ep} does not divide dp·cp·tp = {fold}: expert parallelism folds over those ranks")
        self.sizes.update(ep=ep, edp=fold // ep)
        self.device = device
        self._dm = device_mesh  # torch DeviceMesh; None for the one-process mesh
        # Rank and coordinates are read once, so they stay valid after the group is gone.
        self.rank = device_mesh.get_rank() if device_mesh is not None else 0
        coord = dict(zip(MESH_AXES, device_mesh.get_coordinate() if device_mesh is not None else (0,) * 4))
        self.batch_coord = coord["dp"]
        self._coord = {"pp": coord["pp"], "dp": coord["dp"] * self.cp + coord["cp"], "cp": coord["cp"],
                       "tp": coord["tp"]}
        fold_coord = self._coord["dp"] * self.sizes["tp"] + self._coord["tp"]
        self._coord.update(ep=fold_coord % ep, edp=fold_coord // ep)
        # Global rank at every coordinate, read once (for point-to-point peers).
        self._ranks = device_mesh.mesh.tolist() if device_mesh is not None else [[[[0]]]]
        self._replicas = None  # the flattened dp × cp group, made by `build` when cp > 1
        self._experts: dict[str, object] = {}  # "ep" and "edp": the groups `build` makes when ep > 1
        self._channels: dict[tuple[str, str], object] = {}  # (axis, name) -> a second group along the axis
        self.seed = 0  # what `meshtrain.init` was given: dropout masks and drawn weights follow it
        self._comm = None

    @classmethod
    def build(cls, pp: int, dp: int, tp: int, device, cp: int = 1, ep: int = 1) -> "Mesh":
        """Collective: every rank of the default process group must call it."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        world = dist.get_world_size()
        if world != pp * dp * cp * tp:
            raise ValueError(f"world size {world} != pp×dp×cp×tp = {pp}×{dp}×{cp}×{tp}")
        dm = init_device_mesh(device.type, (pp, dp, cp, tp), mesh_dim_names=MESH_AXES)
        mesh = cls({"pp": pp, "dp": dp, "cp": cp, "tp": tp, "ep": ep}, device, dm)
        if cp > 1:  # every rank makes every replica group, in the same order
            mesh._replicas, _ = dist.new_subgroups_by_enumeration(mesh.axis_ranks("dp"))
        if ep > 1:
            for axis in ("ep", "edp"):
                if mesh.size(axis) > 1:
                    mesh._experts[axis], _ = dist.new_subgroups_by_enumeration(mesh.axis_ranks(axis))
        return mesh

    @classmethod
    def single(cls, device) -> "Mesh":
        """One process, every axis of size 1: the reference run; needs no process group."""
        return cls({}, device)

    @property
    def world_size(self) -> int:
        return self.sizes["pp"] * self.sizes["dp"] * self.sizes["tp"]  # dp holds cp

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
        if axis in ("ep", "edp"):  # the folded position f = edp·ep + ep, over dp·cp (flattened) and tp
            ep, edp = (coord, self.coord("edp")) if axis == "ep" else (self.coord("ep"), coord)
            f = edp * self.size("ep") + ep
            return self._global({"pp": self.coord("pp"), "dp": f // self.size("tp"), "tp": f % self.size("tp")})
        at = {a: self._coord[a] for a in AXES}
        at[axis] = coord  # a cp coordinate replaces the one the flattened dp holds
        return self._global(at)

    def neighbour(self, axis: str, offset: int, *, wrap: bool = False) -> int | None:
        """The global rank `offset` steps along `axis` (the next pipeline stage is
        `neighbour("pp", +1)`); None past either end unless `wrap`."""
        coord = self.coord(axis) + offset
        if wrap:
            coord %= self.size(axis)
        return self.rank_at(axis, coord) if 0 <= coord < self.size(axis) else None

    def axis_ranks(self, axis: str) -> list[list[int]]:
        """The global ranks of every group along `axis`, each in coordinate order."""
        if axis in ("ep", "edp"):  # folded over each stage's dp × cp × tp ranks, tp innermost
            ep, tp = self.size("ep"), self.size("tp")
            groups = []
            for pp in range(self.size("pp")):
                folded = [self._global({"pp": pp, "dp": f // tp, "tp": f % tp})
                          for f in range(self.size("dp") * tp)]
                groups += ([folded[i:i + ep] for i in range(0, len(folded), ep)] if axis == "ep"
                           else [folded[j::ep] for j in range(ep)])
            return groups
        if axis == "cp":  # a ring per (pp, batch dp, tp)
            return [[self._global({"pp": pp, "dp": bdp * self.cp + c, "tp": tp}) for c in range(self.cp)]
                    for pp in range(self.size("pp")) for bdp in range(self.batch_dp) for tp in range(self.size("tp"))]
        others = [a for a in AXES if a != axis]
        return [[self._global({**dict(zip(others, at)), axis: c}) for c in range(self.size(axis))]
                for at in product(*(range(self.size(a)) for a in others))]

    def _global(self, at: dict[str, int]) -> int:
        """The rank at (pp, dp, tp) of the strategies' view (dp: the flattened dp × cp); a
        `cp` coordinate, if given, replaces the flattened one's."""
        dp, cp = divmod(at["dp"], self.cp)
        return self._ranks[at["pp"]][dp][at.get("cp", cp)][at["tp"]]

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
        axes = [self.group(axis) for axis in MESH_AXES if self.size(axis) > 1 and self._dm is not None]
        return axes + list(self._experts.values()) + list(self._channels.values())

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
        if axis == "dp" and self._replicas is not None:
            return self._replicas
        if axis in ("ep", "edp"):
            return self._experts.get(axis)
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
        replica trains on (contiguous, in dp coordinate order; the ranks of one cp ring share
        them): what `job.step(..., rows="local")` expects this rank to pass."""
        n = self.batch_dp
        if batch_size % n:
            raise ValueError(f"a batch of {batch_size} rows does not split over dp={n}; use a multiple of {n}")
        local = batch_size // n
        return slice(self.batch_coord * local, (self.batch_coord + 1) * local)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def __repr__(self) -> str:
        """The sizes `size(axis)` answers: dp is the parameters' replicas, so under cp it is
        written as the batch's dp × cp (`--dp 1 --cp 2`: dp=2 (batch dp 1 × cp 2))."""
        dp = f"{self.sizes['dp']} (batch dp {self.batch_dp} × cp {self.cp}), cp={self.cp}" if self.cp > 1 else self.batch_dp
        ep = f", ep={self.sizes['ep']}" if self.sizes["ep"] > 1 else ""
        return f"Mesh(pp={self.sizes['pp']}, dp={dp}, tp={self.sizes['tp']}{ep}, rank={self.rank})"

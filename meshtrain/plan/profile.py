"""A machine profile: what `meshtrain plan --calibrate` measured here (`cli/calibrate.py`
measures; this module holds, saves, reads and answers from the figures), which the
planner's step-time model takes through `plan --machine FILE`, as `ProfileRates`.

Matmul rate depends on shape (small or skinny products are overhead- or memory-bound), so
it was measured over a grid of (m, k, n); between grid points the time is interpolated
(multilinear in log m, log k, log n; see `MachineProfile.matmul_flops_per_s`). Collective
times are per byte THIS rank sends, as `meshtrain.comm` counts it, so that the planner's
byte counts convert directly to time."""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from itertools import product
from pathlib import Path

from meshtrain.plan.planner import PlanError
from meshtrain.atomic import atomic_write

FORMAT = "meshtrain-machine-profile/1"
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p", "all_to_all")
DTYPES = ("fp32", "bf16")


@dataclass
class MachineProfile:
    device: str            # "cpu" or the GPU's name
    ranks: int             # processes the collectives (and the concurrent matmuls) were measured with
    threads_per_rank: int  # torch threads each rank used, as the trainer's ranks do
    matmul: list[dict]     # {"m", "k", "n", "dtype", "flops_per_s"}, and "batch" for a torch.bmm point
    elementwise_bytes_per_s: float  # bytes read + written per second by a layer's mix of elementwise ops
    op_overhead_s: float   # one forward op on a tiny tensor, recorded by autograd as in training
    collectives: dict      # kind -> {"latency_s", "bytes_per_s"}, bytes as this rank sends them
    created: str
    torch_version: str
    host: str
    backward_op_overhead_s: float = 0.0  # one autograd backward node of a tiny op
    elementwise_ops: dict = field(default_factory=dict)  # op -> bytes/s ("add", "gelu", ...), each alone
    # A synchronous collective's extra wait for the slower rank after `compute_s` of compute
    # since the last one: [{"compute_s", "extra_s"}], extra over the shortest compute measured.
    collective_skew: list = field(default_factory=list)
    # The elementwise mix's rate by the size of the tensors it runs on: [{"tensor_bytes",
    # "bytes_per_s"}]. Small tensors stay in cache and reuse freed memory; the 64 MiB ones of
    # `elementwise_bytes_per_s` fault fresh pages in on every call (measured: gelu 8 GB/s
    # at 1-4 MiB, 1.9 at 64 MiB).
    elementwise_by_size: list = field(default_factory=list)
    # The step after backward as the trainer runs it (clipping's norm and scale, AdamW), all
    # ranks at once: {"s_per_param", "s_per_tensor"}; empty in a profile taken before it was.
    optimizer_step: dict = field(default_factory=dict)
    # How long the calibration took: {"ranks_started", "measuring", "budget"} in seconds (the
    # budget bounds the measuring; starting the ranks is Python and torch loading).
    calibration_s: dict = field(default_factory=dict)

    # -- matmul ---------------------------------------------------------------------------

    def matmul_flops_per_s(self, m: int, k: int, n: int, dtype: str = "fp32") -> float:
        """FLOP/s of an (m×k)·(k×n) product: 2mkn over the interpolated time. Inside the grid
        the time is multilinear in (log m, log k, log n) over the measured grid, made
        nondecreasing along each axis by lowering a point to the time of any larger product
        that ran faster (other processes only ever slow a measurement down, so the lower
        figure is the truer one). Beyond the largest grid value of an axis the time grows in
        proportion (the edge's rate is kept); below the smallest it stays at the edge's time
        (overhead-bound). So time is monotone in each dimension and the rate bounded."""
        return 2.0 * m * k * n / self._grid(dtype).time(m, k, n)

    def matmul_time(self, m: int, k: int, n: int, dtype: str = "fp32", batch: int = 1) -> float:
        """Seconds of `batch` products (m×k)·(k×n). batch > 1 is a torch.bmm (attention): timed
        as the row-stacked product (batch·m)×k·(k×n), corrected by how the measured bmm
        points ran against that model (1 when none were measured), and never under the time
        of one of its products (a factor fitted where dispatch dominates could say so)."""
        if min(m, k, n, batch) <= 0:
            return 0.0
        one = self._grid(dtype).time(m, k, n)
        if batch == 1:
            return one
        return max(one, self._grid(dtype).time(batch * m, k, n) / self._bmm_factor(dtype))

    def _grid(self, dtype: str) -> "_Grid":
        cache = self.__dict__.setdefault("_cache", {})
        if ("grid", dtype) not in cache:
            points = [p for p in self.matmul if p["dtype"] == dtype and p.get("batch", 1) == 1]
            if not points:
                raise ValueError(f"the machine profile has no {dtype} matmul measurements")
            cache["grid", dtype] = _Grid(points)
        return cache["grid", dtype]

    def _bmm_factor(self, dtype: str) -> float:
        """Geometric mean of measured bmm rate / row-stacked mm model rate."""
        cache = self.__dict__.setdefault("_cache", {})
        if ("bmm", dtype) not in cache:
            grid = self._grid(dtype)
            logs = [math.log(p["flops_per_s"] * grid.time(p["batch"] * p["m"], p["k"], p["n"])
                             / (2.0 * p["batch"] * p["m"] * p["k"] * p["n"]))
                    for p in self.matmul if p["dtype"] == dtype and p.get("batch", 1) > 1]
            cache["bmm", dtype] = math.exp(sum(logs) / len(logs)) if logs else 1.0
        return cache["bmm", dtype]

    # -- the rest ---------------------------------------------------------------------------

    def elementwise_time(self, nbytes: float, op: str | None = None) -> float:
        """Seconds of elementwise ops moving `nbytes` (read + written), without dispatch cost:
        at the large-tensor mix's rate, or at `op`'s own (one of `elementwise_ops`) when given.
        (`elementwise_by_size` is kept for the record: `ProfileRates.elementwise_time` says
        why the step model does not use it.)"""
        rate = self.elementwise_bytes_per_s if op is None else self.elementwise_ops[op]
        return max(0.0, nbytes) / rate

    def optimizer_time(self, params: float, tensors: int) -> float | None:
        """Seconds of the step after backward over `params` parameters in `tensors` tensors
        (None when the profile has no such measurement)."""
        if not self.optimizer_step:
            return None
        return params * self.optimizer_step["s_per_param"] + tensors * self.optimizer_step["s_per_tensor"]

    def collective_time(self, kind: str, sent_bytes: float) -> float:
        """Seconds of one collective of `kind` in which this rank sends `sent_bytes` (as
        `meshtrain.comm` counts them); 0 for nothing sent (a group of one)."""
        if sent_bytes <= 0:
            return 0.0
        c = self.collective(kind)
        return c["latency_s"] + sent_bytes / c["bytes_per_s"]

    def collective(self, kind: str) -> dict:
        """What was measured of `kind`; a ValueError naming the fix when nothing was."""
        if kind not in self.collectives:
            known = ", ".join(self.collectives) or f"none: calibrated with {self.ranks} rank"
            raise ValueError(f"the machine profile has no {kind!r} measurement (it has {known}); recalibrate with "
                             f"`meshtrain plan --calibrate`")
        return self.collectives[kind]

    def save(self, path) -> None:
        text = json.dumps({"format": FORMAT, **asdict(self)}, indent=1) + "\n"
        atomic_write(Path(path), lambda tmp: tmp.write_text(text))

    @classmethod
    def load(cls, path) -> "MachineProfile":
        """Read a saved profile; any problem is one ValueError line naming the file."""
        try:
            with open(path) as f:
                data = json.load(f)
        except OSError as e:
            raise ValueError(f"machine profile {path}: cannot read it ({e.strerror or e})") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"machine profile {path}: not JSON ({str(e).splitlines()[0]}); "
                             f"make one with `meshtrain plan --calibrate`") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"machine profile {path}: format is {found!r}, expected {FORMAT!r}; "
                             f"make one with `meshtrain plan --calibrate`")
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        missing = sorted(required - data.keys())
        if missing:
            raise ValueError(f"machine profile {path}: missing {', '.join(missing)}; "
                             f"recalibrate with `meshtrain plan --calibrate`")
        profile = cls(**{k: v for k, v in data.items() if k in names})
        try:
            profile._check()
        except (TypeError, KeyError, ValueError) as e:
            raise ValueError(f"machine profile {path}: {e}; recalibrate with `meshtrain plan --calibrate`") from None
        return profile

    def _check(self) -> None:
        """Every number the model divides by is positive and finite."""
        def good(x) -> bool:
            return isinstance(x, (int, float)) and math.isfinite(x) and x > 0
        if not self.matmul:
            raise ValueError("no matmul measurements")
        for p in self.matmul:
            if p["dtype"] not in DTYPES or not all(good(p[key]) for key in ("m", "k", "n", "flops_per_s")):
                raise ValueError(f"bad matmul point {p}")
        for name in ("elementwise_bytes_per_s", "op_overhead_s"):
            if not good(getattr(self, name)):
                raise ValueError(f"bad {name} {getattr(self, name)!r}")
        for kind, c in self.collectives.items():
            if not (good(c["latency_s"]) and good(c["bytes_per_s"])):
                raise ValueError(f"bad {kind} figures {c}")
        for p in self.elementwise_by_size:
            if not (good(p["tensor_bytes"]) and good(p["bytes_per_s"])):
                raise ValueError(f"bad elementwise point {p}")
        if self.optimizer_step and not (good(self.optimizer_step["s_per_param"])
                                        and math.isfinite(self.optimizer_step["s_per_tensor"])
                                        and self.optimizer_step["s_per_tensor"] >= 0):
            raise ValueError(f"bad optimizer step figures {self.optimizer_step}")
        for p in self.collective_skew:
            if not (good(p["compute_s"]) and math.isfinite(p["extra_s"])):
                raise ValueError(f"bad collective skew point {p}")

    def skew_time(self, compute_s: float) -> float:
        """The extra wait of a synchronous collective issued `compute_s` seconds of compute
        after the previous one: interpolated between the measured points, flat beyond them
        (0 for a profile without them)."""
        points = sorted((p["compute_s"], max(0.0, p["extra_s"])) for p in self.collective_skew)
        if not points:
            return 0.0
        if compute_s <= points[0][0]:
            return points[0][1]
        for (c0, e0), (c1, e1) in zip(points, points[1:]):
            if compute_s <= c1:
                return e0 + (e1 - e0) * (compute_s - c0) / (c1 - c0)
        return points[-1][1]


class _Grid:
    """log-time of measured (m, k, n) products on the product grid of their values."""

    def __init__(self, points: list[dict]):
        self.axes = [sorted({int(p[a]) for p in points}) for a in "mkn"]
        self.logx = [[math.log(v) for v in axis] for axis in self.axes]
        measured = {(int(p["m"]), int(p["k"]), int(p["n"])): 2.0 * p["m"] * p["k"] * p["n"] / p["flops_per_s"]
                    for p in points}
        shape = [len(a) for a in self.axes]
        t = {}
        for i, j, l in product(*(range(s) for s in shape)):
            key = (self.axes[0][i], self.axes[1][j], self.axes[2][l])
            t[i, j, l] = measured[key] if key in measured else self._fill(key, measured)
        # Nondecreasing along each axis in turn: a suffix minimum from the large end (each
        # pass keeps the order the earlier passes made).
        for axis in range(3):
            for idx in reversed(list(product(*(range(s) for s in shape)))):
                if idx[axis] + 1 < shape[axis]:
                    nxt = list(idx)
                    nxt[axis] += 1
                    t[idx] = min(t[idx], t[tuple(nxt)])
        self.logt = {idx: math.log(v) for idx, v in t.items()}

    @staticmethod
    def _fill(key, measured) -> float:
        """A grid point not measured (over budget): the rate of the largest measured product
        it contains (rates grow with size, so this is the conservative guess), else the
        rate of the nearest measured point in log space."""
        flops = 2.0 * key[0] * key[1] * key[2]
        inside = [s for s in measured if all(a <= b for a, b in zip(s, key))]
        if inside:
            s = max(inside, key=lambda s: s[0] * s[1] * s[2])
        else:
            s = min(measured, key=lambda s: sum(math.log(a / b) ** 2 for a, b in zip(s, key)))
        return flops / (2.0 * s[0] * s[1] * s[2] / measured[s])

    def time(self, m: float, k: float, n: float) -> float:
        cells, extra = [], 0.0
        for x, lx in zip((m, k, n), self.logx):
            u = math.log(max(x, 1e-30))
            if u >= lx[-1]:
                extra += u - lx[-1]  # beyond the grid: time in proportion, the edge's rate
                cells.append((len(lx) - 1, len(lx) - 1, 0.0))
            elif u <= lx[0]:
                cells.append((0, 0, 0.0))  # below: the edge's (overhead-bound) time
            else:
                hi = next(i for i, v in enumerate(lx) if v > u)
                cells.append((hi - 1, hi, (u - lx[hi - 1]) / (lx[hi] - lx[hi - 1])))
        # Trilinear, as nested lerps a + f·(b − a): where the grid is flat along an axis the
        # lerp returns its value exactly, so a flat stretch stays flat to the last bit (a sum
        # of eight weighted corners wobbles there by rounding, and time would seem to fall).
        (m0, m1, fm), (k0, k1, fk), (n0, n1, fn) = cells
        t = self.logt

        def lerp(a: float, b: float, f: float) -> float:
            return a + f * (b - a) if f else a

        def along_m(j: int, n: int) -> float:
            return lerp(t[m0, j, n], t[m1, j, n], fm)

        def along_k(n: int) -> float:
            return lerp(along_m(k0, n), along_m(k1, n), fk)
        return math.exp(lerp(along_k(n0), along_k(n1), fn) + extra)


class ProfileRates:
    """A measured profile as the rates the step-time model asks for. One machine: no link
    crosses nodes; gloo's collectives run on the CPU that computes, so nothing overlaps.
    The profile's ranks computed at once, one per core; `world` ranks share them
    (`shared_cores`: how many ranks a core runs; `cores`: how many there are)."""

    comm_overlap = 0.0

    def __init__(self, profile: MachineProfile, world: int | None = None):
        self.profile = profile
        self.shared_cores = max(1.0, (world or profile.ranks) / profile.ranks)
        self.cores = profile.ranks  # a pipeline's stages share them (`sharing.pipeline_time`)
        self.op_overhead_s = profile.op_overhead_s

    def matmul_time(self, m: int, k: int, n: int, dtype: str = "fp32", batch: int = 1) -> float:
        return self.profile.matmul_time(m, k, n, dtype, batch)

    def elementwise_time(self, nbytes: float) -> float:
        """At the large-tensor mix's rate (`elementwise_bytes_per_s`), not at a rate by tensor
        size: the in-cache rates of small tensors, timed on each rank alone in a loop, made
        every prediction of `benchmarks/plan_accuracy.py` 5-28 % short (two ranks computing
        side by side run ~20 % slower per step than one; the large-tensor rate stands in for
        that contention, which the model has no term for)."""
        return self.profile.elementwise_time(nbytes)

    def optimizer_time(self, params: float, tensors: int) -> float | None:
        return self.profile.optimizer_time(params, tensors)

    def collective_time(self, kind: str, sent_bytes: float, across_nodes: bool = False) -> float:
        """Between the sizes measured, the measured times themselves (interpolated in log-log,
        each no more than any larger size's: load only ever slows a measurement); beyond
        them, the profile's latency + bandwidth fit."""
        kind = "p2p" if kind == "send" else kind
        try:
            measured = self.profile.collective(kind)
        except ValueError as e:  # an older profile: one line, not a traceback
            raise PlanError(str(e)) from None
        points = sorted((p["sent_bytes"], p["time_s"]) for p in measured.get("points", []))
        if sent_bytes <= 0 or len(points) < 2 or not points[0][0] <= sent_bytes <= points[-1][0]:
            return self.profile.collective_time(kind, sent_bytes)
        sizes, times = [math.log(x) for x, _ in points], [t for _, t in points]
        for i in range(len(times) - 2, -1, -1):
            times[i] = min(times[i], times[i + 1])
        x = math.log(sent_bytes)
        i = max(j for j in range(len(sizes) - 1) if sizes[j] <= x)
        w = (x - sizes[i]) / (sizes[i + 1] - sizes[i])
        return math.exp((1 - w) * math.log(times[i]) + w * math.log(times[i + 1]))

    def skew_time(self, compute_s: float) -> float:
        """A synchronous collective's wait for the slower rank after `compute_s` of compute."""
        return self.profile.skew_time(compute_s)

    def peak_flops(self, precision: str) -> float:
        """The fastest matmul measured in this precision: what MFU is taken against here."""
        rates = [p["flops_per_s"] for p in self.profile.matmul if p["dtype"] == precision]
        return max(rates) if rates else 0.0

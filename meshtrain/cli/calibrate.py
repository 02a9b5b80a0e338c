"""Measuring this machine for the planner's step-time model (`meshtrain plan --calibrate`
writes a `profile.MachineProfile`, `plan --machine FILE` reads it).

A step's time is matmuls, memory-bound elementwise ops, the fixed cost of dispatching each
op, and collectives. Each is measured the way a rank of a training run meets it: inside
`ranks` spawned processes joined in a process group (gloo on CPU, NCCL on CUDA), with the
thread count the trainer gives its ranks (`launch.threads_per_rank`), all ranks computing
at the same time (on a small CPU they share caches and memory bandwidth), and each
collective through `torch.distributed`. Collective bandwidth is per byte THIS rank sends,
as `meshtrain.comm` counts it, so that the planner's byte counts convert directly to time.

Matmul rate depends on shape, so it is measured over a grid of (m, k, n) covering a small
GPT's linears, smallest first, until the phase's share of the time budget runs out (bf16 on
a CPU without bf16 units is ~50x slower than fp32: only its small corner fits)."""

from __future__ import annotations

import multiprocessing as mp
import platform
import queue
import socket
import statistics
import sys
import time
import traceback
from datetime import datetime, timezone
from itertools import product

from meshtrain.cli.config import TrainConfig
from meshtrain.launch import RankEnv, finish, init_distributed
from meshtrain.plan.profile import KINDS, MachineProfile

# -- measurement ------------------------------------------------------------------------------

# The shapes of a small GPT's linears: m tokens of a micro-batch, k → n features.
GRID = {"m": (64, 256, 1024, 4096, 8192), "k": (32, 128, 512, 2048, 4096), "n": (32, 128, 512, 2048, 4096)}
QUICK_GRID = {"m": (64, 256, 1024), "k": (32, 128, 512), "n": (32, 128, 512)}
# Attention's batched products (batch·heads, s, d_head): scores (s×d)·(d×s), weighting (s×s)·(s×d).
BMM = {"batch": 16, "s": (128, 512, 1024), "d": (32, 64, 128)}
QUICK_BMM = {"batch": 8, "s": (64, 256), "d": (32,)}
SIZES = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)  # collective payloads B (bytes)
QUICK_SIZES = (4 << 10, 64 << 10, 1 << 20)
# The fixed phases' tensors in bytes: the elementwise rate's (one well past the caches, then
# smaller ones), and each of the optimizer's large ones in elements. `quick` (the tests'
# calibration) takes small ones, so that most of a short budget is left to the matmul grid.
FIXED = {"cpu": {"elementwise": 64 << 20, "by_size": (256 << 10, 1 << 20, 4 << 20, 16 << 20), "optimizer": 1 << 20},
         "cuda": {"elementwise": 512 << 20, "by_size": (4 << 20, 64 << 20), "optimizer": 16 << 20},
         "quick": {"elementwise": 8 << 20, "by_size": (256 << 10, 1 << 20, 4 << 20), "optimizer": 256 << 10}}


def calibrate(ranks: int = 2, budget_s: float = 40.0, progress=None, *, quick: bool = False,
              device: str = "auto", timeout_s: float | None = None) -> MachineProfile:
    """Measure this machine in about `budget_s` seconds with `ranks` processes, counted from
    when they are up (starting them, which is Python importing torch and the process group
    forming, takes 5-10 s more here, and longer on a cold or loaded machine: it is not the
    measurement's to shorten); `progress(line)` is called once per phase. `quick` shrinks the grids
    (tests). `device`: "auto" (CUDA when present), "cpu" or "cuda". Raises ValueError (one
    line) when CUDA has fewer GPUs than ranks, RuntimeError when a rank fails."""
    start = time.time()
    import torch
    if ranks < 1:
        raise ValueError(f"calibrate: ranks must be at least 1, not {ranks}")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda and torch.cuda.device_count() < ranks:
        raise ValueError(f"calibrate: {ranks} ranks need {ranks} GPUs, {torch.cuda.device_count()} visible; "
                         f"calibrate with ranks={max(1, torch.cuda.device_count())} or on the CPU")
    say = progress or (lambda line: None)
    ctx = mp.get_context("spawn")
    for attempt in range(3):
        q = ctx.Queue()
        port = _free_port()
        procs = [ctx.Process(target=_rank_main, args=(r, ranks, port, use_cuda, start, budget_s, quick, q),
                             daemon=True) for r in range(ranks)]
        for p in procs:
            p.start()
        try:
            result, errors = _collect(q, procs, say, start + (timeout_s or budget_s + 180))
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(5)
        if errors and attempt < 2 and any("address already in use" in e.lower() or "EADDRINUSE" in e for e in errors):
            continue  # another process took the port between picking and binding it
        if errors:
            raise RuntimeError("calibrate: a rank failed:\n" + "\n".join(errors))
        if result is None:
            raise RuntimeError(f"calibrate: the ranks ended without a result (exit codes {[p.exitcode for p in procs]})")
        profile = MachineProfile(**result)
        profile._check()
        say(f"calibrated in {time.time() - start:.1f} s")
        return profile
    raise RuntimeError("calibrate: could not find a free port")


def stderr_progress(line: str) -> None:
    print(f"meshtrain: calibrate: {line}", file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collect(q, procs, say, deadline):
    """Relay rank 0's progress lines until the result or every rank's error arrives."""
    result, errors = None, []
    while time.time() < deadline:
        try:
            kind, payload = q.get(timeout=0.2)
        except queue.Empty:
            if all(not p.is_alive() for p in procs):
                try:  # a last message may still be in the pipe
                    kind, payload = q.get(timeout=1.0)
                except queue.Empty:
                    return result, errors
            else:
                continue
        if kind == "progress":
            say(payload)
        elif kind == "result":
            return payload, errors
        else:
            errors.append(payload)
            return result, errors
    errors.append("the ranks hung: no result before the time limit")
    return result, errors


def _rank_main(rank, world, port, use_cuda, start, budget_s, quick, q):
    code = 0
    try:
        out = _measure(rank, world, port, use_cuda, start, budget_s, quick,
                       lambda line: q.put(("progress", line)) if rank == 0 else None)
        if rank == 0:
            q.put(("result", out))
    except BaseException:
        code = 1
        q.put(("error", f"rank {rank}: {traceback.format_exc()}"))
    q.close()
    q.join_thread()  # the message is in the pipe before the process leaves
    finish(code)


class _Rank:
    """What a measuring rank needs: its device, a clock every rank agrees on, and reductions."""

    def __init__(self, rank, world, device, start, say):
        import torch
        self.torch, self.rank, self.world, self.device, self.start, self.say = torch, rank, world, device, start, say
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def agree(self, values, op="sum") -> list[float]:
        """Values reduced over the ranks (mean for "sum", max for "max"): every rank then makes
        the same choices, so their collectives stay matched."""
        import torch.distributed as dist
        t = self.torch.tensor(values, dtype=self.torch.float64 if not self.cuda else self.torch.float32,
                              device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        out = t.tolist()
        return [v / self.world for v in out] if op == "sum" else out

    def elapsed(self) -> float:
        """Seconds since calibrate began, the same on every rank (the latest rank's clock)."""
        return self.agree([time.time() - self.start], op="max")[0]

    def time(self, fn, min_sample_s: float, reps: int | None = None) -> float:
        """Median seconds of one call of `fn` after a warm-up, each sample long enough to
        time (tiny ops loop); 5 samples of a call under 10 ms, else 3."""
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        first = time.perf_counter() - t0
        inner = max(1, min(10_000, int(min_sample_s / max(first, 1e-7))))
        reps = reps or (5 if first < 0.01 else 3)
        samples = []
        for _ in range(reps):
            self.sync()
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            self.sync()
            samples.append((time.perf_counter() - t0) / inner)
        return statistics.median(samples)


def _measure(rank, world, port, use_cuda, start, budget_s, quick, say) -> dict:
    import torch
    import torch.distributed as dist


    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    init_distributed(RankEnv("calibrate", rank, world, rank, world, "127.0.0.1", port), device)
    if use_cuda:
        torch.backends.cuda.matmul.allow_tf32 = False  # meshtrain's fp32 is true fp32 (see plan/cost.py)
        torch.backends.cudnn.allow_tf32 = False
    r = _Rank(rank, world, device, start, say)
    threads = torch.get_num_threads()
    # A torch optimizer's first construction imports torch._dynamo (~2 s here): loading, as
    # in a run's set-up, not the step the optimizer phase times, so before the budget starts.
    torch.optim.AdamW([torch.zeros(1, device=device, requires_grad=True)])
    started = r.elapsed()
    say(f"{world} rank(s) on {'cuda' if use_cuda else 'cpu'} ({dist.get_backend()}, {threads} thread(s) each) "
        f"started in {started:.1f} s")
    deadline = started + budget_s - 1.0  # seconds after the start; the last second is for leaving

    op_fwd, op_bwd = _op_overhead(r)
    say(f"op overhead: {op_fwd * 1e6:.1f} us forward, {op_bwd * 1e6:.1f} us per backward node")
    fixed = FIXED["quick" if quick else "cuda" if use_cuda else "cpu"]
    ew = _elementwise(r, fixed["elementwise"])
    ew_rate = ew.pop("mix")
    say("elementwise: " + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in ew.items()) + f" GB/s; mix {ew_rate / 1e9:.2f}")
    by_size = [{"tensor_bytes": size, "bytes_per_s": _elementwise(r, size)["mix"]} for size in fixed["by_size"]]
    by_size.append({"tensor_bytes": fixed["elementwise"], "bytes_per_s": ew_rate})
    say("elementwise mix by tensor size: " + ", ".join(f"{p['tensor_bytes'] >> 10} KiB {p['bytes_per_s'] / 1e9:.2f}"
                                                       for p in by_size) + " GB/s")
    optimizer = _optimizer_step(r, fixed["optimizer"])
    say(f"optimizer step: {optimizer['s_per_param'] * 1e9:.2f} ns a parameter + "
        f"{optimizer['s_per_tensor'] * 1e6:.1f} us a tensor")
    collectives = _collectives(r, QUICK_SIZES if quick else SIZES, quick) if world > 1 else {}
    if collectives:
        say("collectives: " + "; ".join(f"{k} {c['latency_s'] * 1e6:.0f} us + {c['bytes_per_s'] / 1e9:.2f} GB/s"
                                         for k, c in collectives.items()))
    skew = _skew(r, quick) if world > 1 and not use_cuda else []
    if skew:
        say("wait for the slower rank: " + ", ".join(f"+{p['extra_s'] * 1e3:.2f} ms after {p['compute_s'] * 1e3:.0f} ms"
                                                     for p in skew))

    grid, bmm = (QUICK_GRID, QUICK_BMM) if quick else (GRID, BMM)
    phases = [("fp32", False, 5.0), ("fp32", True, 1.0), ("bf16", False, 3.0), ("bf16", True, 1.0)]
    points = []
    for i, (dtype, batched, weight) in enumerate(phases):
        now = r.elapsed()
        share = weight / sum(w for _, _, w in phases[i:])
        phase_end = now + share * max(0.0, deadline - now)
        shapes = _bmm_shapes(bmm) if batched else [(1, *s) for s in product(grid["m"], grid["k"], grid["n"])]
        got = _matmuls(r, dtype, sorted(shapes, key=lambda s: s[0] * s[1] * s[2] * s[3]), phase_end)
        points += got
        rates = [p["flops_per_s"] for p in got]
        say(f"{'bmm' if batched else 'matmul'} {dtype}: {len(got)}/{len(shapes)} shapes in {r.elapsed() - now:.1f} s"
            + (f", {min(rates) / 1e9:.3g}-{max(rates) / 1e9:.3g} GFLOP/s" if rates else ""))
    fastest, level, slowest = _steady(points)
    say(f"the reference product took {fastest * 1e3:.2f}-{slowest * 1e3:.2f} ms, median {level * 1e3:.2f}: "
        f"every shape's rate is taken at the median")

    return dict(device=torch.cuda.get_device_name(device) if use_cuda else "cpu", ranks=world,
                threads_per_rank=threads, matmul=points, elementwise_bytes_per_s=ew_rate, op_overhead_s=op_fwd,
                collectives=collectives, created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                torch_version=torch.__version__, host=platform.node(), backward_op_overhead_s=op_bwd,
                elementwise_ops=ew, collective_skew=skew, elementwise_by_size=by_size, optimizer_step=optimizer,
                calibration_s={"ranks_started": started, "measuring": r.elapsed() - started, "budget": budget_s})


def _op_overhead(r: _Rank) -> tuple[float, float]:
    """Per op: a forward mul on a 16-element tensor that autograd records, and its backward
    node (a chain of 200 such ops, its backward timed whole)."""
    torch = r.torch
    x = torch.ones(16, device=r.device, requires_grad=True)
    chain = 200

    def forward():
        y = x
        for _ in range(chain):
            y = y * 1.0001
        return y

    fwd = r.time(forward, 0.02, reps=5) / chain
    samples = []
    for _ in range(5):
        y = forward().sum()
        r.sync()
        t0 = time.perf_counter()
        y.backward()
        r.sync()
        samples.append(time.perf_counter() - t0)
    return fwd, statistics.median(samples) / chain


def _elementwise(r: _Rank, nbytes: int) -> dict[str, float]:
    """Bytes read + written per second by each of a transformer layer's memory-bound ops on
    an fp32 tensor of `nbytes`, and "mix": all their bytes over all their time (on a CPU
    rank of one thread, gelu and softmax are compute-bound: the mix says so)."""
    torch, F = r.torch, r.torch.nn.functional
    n = nbytes // 4
    x = torch.randn(n // 1024, 1024, device=r.device)
    y, out = torch.randn_like(x), torch.empty_like(x)
    ops = {"add": (lambda: torch.add(x, y, out=out), 3),
           "scale_": (lambda: out.mul_(0.999), 2),
           "gelu": (lambda: F.gelu(x), 2),
           "layer_norm": (lambda: F.layer_norm(x, (1024,)), 2),
           "softmax": (lambda: torch.softmax(x, -1), 2)}
    rates, moved, spent = {}, 0.0, 0.0
    for name, (fn, tensors) in ops.items():
        t = r.agree([r.time(fn, 0.0, reps=3)])[0]  # both ranks at once; their mean time
        rates[name] = tensors * n * 4 / t
        moved, spent = moved + tensors * n * 4, spent + t
    rates["mix"] = moved / spent
    return rates


def _optimizer_step(r: _Rank, elements: int) -> dict[str, float]:
    """Seconds per parameter and per tensor of the step after backward as `train_step` runs
    it: each gradient's squared norm summed in fp64 and the gradients scaled (clipping, as
    `optim.clip_grad_norm_` does it through `sum_of_squares`, less its one-number all-reduce), then the trainer's
    AdamW (`optim.adamw`). Timed on 4 large fp32 tensors (per parameter, with the
    memory traffic of states far past the caches) and on 64 tiny ones (per tensor: the
    dispatch of each op, their 256 elements a rounding error), all ranks at once."""
    from meshtrain.optim import adamw, sum_of_squares  # torch: only in the ranks
    torch = r.torch

    def seconds(count: int, size: int) -> float:
        named = [(f"p{i}", torch.zeros(size, device=r.device, requires_grad=True)) for i in range(count)]
        for _, p in named:
            p.grad = torch.randn_like(p)
        optimizer = adamw(TrainConfig().lr, TrainConfig().weight_decay)(named)
        grads = [p.grad for _, p in named]

        def step():
            norm = sum_of_squares(grads, r.device).sqrt().item()
            for g in grads:
                g.mul_(min(1.0, 1.0 / (norm + 1e-6)))
            optimizer.step()
        return r.agree([r.time(step, 0.02, reps=3)])[0]

    per_tensor = seconds(64, 256) / 64
    t_large = seconds(4, elements)
    # the large set is per-parameter work but for its 4 tensors' dispatch (under 1 % on a CPU)
    per_param = max(t_large - 4 * per_tensor, t_large / 2) / (4 * elements)
    return {"s_per_param": per_param, "s_per_tensor": per_tensor}


def _collectives(r: _Rank, sizes, quick: bool = False) -> dict[str, dict]:
    """Each collective at several payloads, as training meets it: every rank computes the
    same short product, then calls it, and times its own call. A rank's wait for a slower
    peer is part of the cost — averaged over the ranks, a call costs its transfer plus
    E[max] − E[mean] of the ranks' compute times, which is what it adds to a step in which
    every rank must arrive (the ranks of a real run never arrive together either). Latency +
    bytes/bandwidth are fitted on the bytes this rank sends (comm.py's count). A call's time
    is the mean over calls, not the median: a step pays for every call, its spikes too
    (measured on this 2-core VM: the mean of an all-reduce runs 10-60 % over the median)."""
    import torch.distributed as dist

    from meshtrain.comm import _all_gather_tensor, _reduce_scatter_tensor, all_gather_bytes, all_reduce_bytes
    torch, n = r.torch, r.world
    a, b = torch.randn(384, 384, device=r.device), torch.randn(384, 384, device=r.device)  # ~1-2 ms on a CPU core
    out = {}
    for kind in KINDS:
        xs, ys = [], []
        for size in sizes:
            elems = size // 4 // n * n
            full = torch.ones(elems, device=r.device)
            shard = torch.ones(elems // n, device=r.device)
            received = torch.empty_like(full)
            call, sent = {
                "all_reduce": (lambda: dist.all_reduce(full), all_reduce_bytes(elems * 4, n)),
                "all_gather": (lambda: _all_gather_tensor(full, shard), all_gather_bytes(elems * 4, n)),
                "reduce_scatter": (lambda: _reduce_scatter_tensor(shard, full), all_gather_bytes(elems * 4, n)),
                "broadcast": (lambda: dist.broadcast(full, src=0), all_gather_bytes(elems * 4, n)),
                "p2p": ((lambda: dist.send(full, 1)) if r.rank == 0 else
                        (lambda: dist.recv(full, 0)) if r.rank == 1 else (lambda: None), elems * 4),
                "all_to_all": (lambda: dist.all_to_all_single(received, full), all_gather_bytes(elems * 4, n)),
            }[kind]
            calls = (10 if size >= (4 << 20) else 24 if size >= (256 << 10) else 40) // (3 if quick else 1)
            call()
            dist.barrier()
            own = []
            for _ in range(calls):
                a @ b  # the compute between two collectives of a training step
                r.sync()
                t0 = time.perf_counter()
                call()
                r.sync()
                own.append(time.perf_counter() - t0)
            xs.append(sent)
            ys.append(r.agree([statistics.mean(own)])[0])
        latency, bw = _fit(xs, ys)
        out[kind] = {"latency_s": latency, "bytes_per_s": bw,
                     "points": [{"sent_bytes": x, "time_s": y} for x, y in zip(xs, ys)]}
    return out


def _skew(r: _Rank, quick: bool) -> list[dict]:
    """How a synchronous collective's wait grows with the compute before it. Ranks that
    compute the same work still finish it at different times (the OS schedules them apart;
    on a small VM they share cores), and each collective waits for the last: the longer the
    compute since the previous one, the longer that wait (measured here: an all-reduce of
    1 MiB after 2, 8 and 24 ms of matmuls takes about 2.5, 4 and 4.5 ms). The collectives
    above were timed after one short product; each point here is the extra wait after 1, 4
    and 12 of them, so that the planner can add it for the compute a layout puts between its
    synchronous collectives (tensor parallelism's). A CPU's only: on a GPU the launch returns
    at once and NCCL waits on the device."""
    import torch.distributed as dist
    torch = r.torch
    a, b = torch.randn(384, 384, device=r.device), torch.randn(384, 384, device=r.device)
    full = torch.ones((1 << 20) // 4 if not quick else 4096, device=r.device)
    calls = 6 if quick else 40
    points = []
    for products in (1, 4, 12):
        dist.barrier()
        compute, waits = [], []
        for _ in range(calls):
            t0 = time.perf_counter()
            for _ in range(products):
                a @ b
            t1 = time.perf_counter()
            dist.all_reduce(full)
            waits.append(time.perf_counter() - t1)
            compute.append(t1 - t0)
        c, w = r.agree([statistics.mean(compute), statistics.mean(waits)])
        points.append({"compute_s": c, "wait_s": w})
    return [{"compute_s": p["compute_s"], "extra_s": p["wait_s"] - points[0]["wait_s"]} for p in points]


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """latency + bytes/bandwidth by least squares in relative error (weights 1/y²), so the
    small sizes fix the latency and the large ones the bandwidth. Should noise make the
    intercept or slope non-positive: the smallest size's time is the latency, and the
    bandwidth comes from the largest size."""
    w = [1.0 / y ** 2 for y in ys]
    sw, sx, sy = sum(w), sum(wi * x for wi, x in zip(w, xs)), sum(wi * y for wi, y in zip(w, ys))
    sxx = sum(wi * x * x for wi, x in zip(w, xs))
    sxy = sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    det = sw * sxx - sx * sx
    slope = (sw * sxy - sx * sy) / det if det else 0.0
    latency = (sy - slope * sx) / sw
    if latency > 0 and slope > 0:
        return latency, 1.0 / slope
    i, j = min(range(len(xs)), key=xs.__getitem__), max(range(len(xs)), key=xs.__getitem__)
    latency = ys[i]
    extra = ys[j] - latency
    return latency, xs[j] / (extra if extra > 0 else ys[j])


def _bmm_shapes(spec) -> list[tuple[int, int, int, int]]:
    b = spec["batch"]
    return sorted({s for s_len in spec["s"] for d in spec["d"] for s in ((b, s_len, d, s_len), (b, s_len, s_len, d))})


REFERENCE = (256, 256, 256)  # the fp32 product timed before every shape: the machine's speed at that moment


def _steady(points: list[dict]) -> float:
    """Take each point's rate at the calibration's median speed, not at the moment's: a
    shared machine slows down and speeds up for seconds at a time (measured here: 20 s of
    shapes 40 % slower than in the calibration before), which would bend the grid's shape.
    Each point carries the reference product's time just before it (`reference_s`, removed
    here); its rate is scaled by that over the median. Returns the reference's (fastest,
    median, slowest) seconds."""
    refs = [p.pop("reference_s") for p in points]
    level = statistics.median(refs)
    for p, ref in zip(points, refs):
        p["flops_per_s"] *= ref / level
    return min(refs), level, max(refs)


def _matmuls(r: _Rank, dtype: str, shapes, phase_end: float) -> list[dict]:
    """Rate of each (batch, m, k, n) shape, cheapest first, all ranks at once, while the
    predicted cost of the next one fits before `phase_end` (seconds since the start), each
    after a timing of the `REFERENCE` product (see `_steady`)."""
    torch = r.torch
    tdtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    min_sample = 2e-3
    ref_a, ref_b = torch.randn(*REFERENCE[:2], device=r.device), torch.randn(*REFERENCE[1:], device=r.device)
    points, rate, now = [], None, r.elapsed()
    for b, m, k, n in shapes:
        flops = 2.0 * b * m * k * n
        if rate is not None:
            call = flops / rate
            # warm-up + samples (+ a tiny op's loop) + agreement; rates can fall with size (bf16 on CPU)
            cost = 1.5 * ((4 if call >= 0.01 else 6) * call + 10 * min_sample) + 0.01
            if now + cost > phase_end:
                break  # shapes are in increasing cost: the rest do not fit either
        a = torch.randn(b, m, k, device=r.device, dtype=tdtype)
        w = torch.randn(b, k, n, device=r.device, dtype=tdtype)
        fn = (lambda: torch.bmm(a, w)) if b > 1 else (lambda: a[0] @ w[0])
        ref = r.time(lambda: ref_a @ ref_b, min_sample)
        t = r.time(fn, min_sample)
        (ref, t), now = r.agree([ref, t]), r.elapsed()  # the ranks' mean times; their common clock
        rate = flops / t
        point = {"m": m, "k": k, "n": n, "dtype": dtype, "flops_per_s": rate, "reference_s": ref}
        if b > 1:
            point["batch"] = b
        points.append(point)
    return points

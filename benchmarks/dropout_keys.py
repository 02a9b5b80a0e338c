"""What a keyed dropout mask costs (issue 51): the device-side hash (`keyed_keep`) against the
per-row CPU generators it replaced (one `torch.Generator` per row and site, the row's whole
mask drawn on the host, then copied), for GPT-2-small's residual and attention-probability
masks of a micro-batch, interleaved, one thread by default. Prints one JSON line: per shape,
the median seconds of each and their ratio, and (on CUDA) the hash on the device."""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time

import torch

from meshtrain.parallel.dropout import DropoutKeys, keyed_keep

P = 0.1


def per_row_generators(rows: int, shape: list[int], device: str) -> torch.Tensor:
    """The replaced path: each row's whole mask from a CPU generator keyed by blake2b."""
    masks = []
    for row in range(rows):
        raw = hashlib.blake2b(f"0/0/{row}/site".encode(), digest_size=8).digest()
        g = torch.Generator()
        g.manual_seed(int.from_bytes(raw, "little") & (2 ** 63 - 1))
        masks.append(torch.rand(shape, generator=g) >= P)
    return torch.stack(masks).to(device)


def hashed(rows: int, shape: list[int], device: str) -> torch.Tensor:
    keys = DropoutKeys(0)
    keys.use(0, slice(0, rows))
    return keyed_keep(keys, "site", [torch.arange(n, device=device) for n in shape], shape, P)


def timed(fn, *args, device: str) -> float:
    t0 = time.perf_counter()
    fn(*args)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = {"rows": args.rows, "threads": args.threads, "device": args.device}
    for name, shape in (("residual", [1024, 768]), ("attention", [12, 1024, 1024])):
        old, new = [], []
        for _ in range(args.repeats):
            old.append(timed(per_row_generators, args.rows, shape, args.device, device=args.device))
            new.append(timed(hashed, args.rows, shape, args.device, device=args.device))
        out[name] = {"generators_s": statistics.median(old), "hash_s": statistics.median(new),
                     "hash_over_generators": statistics.median(new) / statistics.median(old)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""`meshtrain export`: a sharded checkpoint of any layout as the one-process model's
safetensors (`checkpoint.export`), or with --hf as a folder transformers loads
(`cli.hf_export`); --out is checked and held first (`cli.export_out`)."""

from __future__ import annotations

import sys
from pathlib import Path

from meshtrain.cli.log import log
from meshtrain.hf import SIDE_FILES, TOKENIZER


def run(args) -> int:
    """`meshtrain export`: --out is checked and held (`export_out`) before anything is read
    or written."""
    from meshtrain.checkpoint.export import DTYPES, export
    from meshtrain.checkpoint.sharded import CheckpointError
    from meshtrain.cli.export_out import writing_into
    bad = [(not args.max_shard_gb > 0, f"--max-shard-gb {args.max_shard_gb}: must be positive"),
           (args.dtype is not None and args.dtype not in DTYPES,
            f"unknown dtype '{args.dtype}'; use --dtype {' | '.join(DTYPES)}")]
    for is_bad, message in bad:
        if is_bad:
            print(f"meshtrain: error: {message}", file=sys.stderr)
            return 2
    dtype, max_shard_bytes = DTYPES.get(args.dtype), int(args.max_shard_gb * 1e9)
    try:
        with writing_into(Path(args.out), Path(args.ckpt), overwrite=args.overwrite, log=log) as ready:
            if args.hf:
                return _export_hf(Path(args.ckpt), Path(args.out), dtype, max_shard_bytes, ready)
            files = export(Path(args.ckpt), Path(args.out), dtype=dtype, max_shard_bytes=max_shard_bytes, log=log,
                           before_writing=ready)
    except (CheckpointError, FileNotFoundError, ValueError) as e:  # export_out's refusals and OutLocked are ValueErrors
        print(f"meshtrain: error: {e}", file=sys.stderr)
        return 2
    log(f"exported {args.ckpt} to {args.out} ({len(files)} weight file{'s' if len(files) > 1 else ''}); "
         f"sample from it with: meshtrain generate --ckpt {args.out}")
    return 0


def _export_hf(ckpt: Path, out: Path, dtype, max_shard_bytes: int, ready) -> int:
    """A Llama or MoE checkpoint (or run folder, or plain export) as a complete Hugging Face folder."""
    from meshtrain.cli.hf_export import export_hf
    files = export_hf(ckpt, out, dtype=dtype, max_shard_bytes=max_shard_bytes, log=log, before_writing=ready)
    written = sorted(name for name in (*SIDE_FILES, TOKENIZER) if (out / name).is_file())
    if "tokenizer.json" not in written:
        log(f"warning: {ckpt} keeps no tokenizer.json, so {out} has none: put the run's tokenizer there before "
             f"loading it with transformers' AutoTokenizer")
    log(f"exported {ckpt} to {out} as a Hugging Face folder ({', '.join(written)} and {len(files)} weight "
         f"file{'s' if len(files) > 1 else ''}); transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}) "
         f"loads it, and so does meshtrain generate --ckpt {out}")
    return 0

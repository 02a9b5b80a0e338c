"""`meshtrain prepare`: text tokenized once into the token folder `train --data DIR` reads
(`data.build`). No torch."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import meshtrain.cli.config as C
from meshtrain.cli.log import log
from meshtrain.data.corpus import DataError


def run(args) -> int:
    """`meshtrain prepare`: no torch; one line for each refusal, and for an interruption
    (Ctrl-C, SIGTERM: the workers stopped, --out left absent, exit 128 + the signal)."""
    from meshtrain.data.build import default_workers, imported_tokenizer_and_rows, prepare_folder
    from meshtrain.data.prepared import find
    vocab, tokenizer = args.vocab_size if args.vocab_size is not None else C.TrainConfig.vocab_size, None
    workers = args.workers if args.workers is not None else default_workers()

    def stop(signum, frame):  # raised where the process is, so that what it was building is removed
        raise KeyboardInterrupt(signal.Signals(signum))
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    try:
        if workers < 1:
            raise C.ConfigError(f"--workers {workers}: use 1 (tokenize in this process) or more")
        if args.init_from is not None:
            if args.vocab_size is not None:
                raise C.ConfigError(f"--vocab-size {args.vocab_size} with --init-from {args.init_from}: the vocabulary "
                                    f"is that folder's tokenizer's; give one of them")
            tokenizer, vocab = imported_tokenizer_and_rows(Path(args.init_from))
        elif not 256 <= vocab <= 2**20:
            raise C.ConfigError(f"--vocab-size {vocab}: use 256 (bytes) up to {2**20:,}")
        if args.data not in C.BUILTIN_DATA and find(args.data) is not None:
            raise C.ConfigError(f"--data {args.data} is a prepared token folder already; train on it with "
                                f"meshtrain train --data {args.data}")
        meta = prepare_folder(args.data, Path(args.out), vocab, tokenizer, log=log, workers=workers,
                              text_field=args.text_field, progress=True)
    except (C.ConfigError, DataError) as e:
        print(f"meshtrain: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        sig = e.args[0] if e.args else signal.SIGINT
        print(f"meshtrain: error: prepare stopped by {sig.name}; --out {args.out} was not written (its "
              f"unfinished folder removed): run it again", file=sys.stderr)
        return 128 + sig
    init = f" --init-from {args.init_from}" if args.init_from else ""
    log(f"prepared {meta['documents']:,} document(s) into {meta['n_tokens']:,} tokens ({meta['dtype']}, "
         f"{len(meta['shards'])} shard(s)) in {args.out}; train on them: meshtrain train --data {args.out}{init}")
    return 0

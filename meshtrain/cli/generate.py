"""`meshtrain generate`: text sampled from a trained run, one of its checkpoints, or an
exported folder."""

from __future__ import annotations

import sys
from pathlib import Path

from meshtrain import launch
import meshtrain.cli.config as C


def run(args) -> int:
    from meshtrain.cli.run_model import end_of_text_ids, load_model
    from meshtrain.generate import sample

    bad = [(args.tokens < 0, f"--tokens {args.tokens}: must not be negative"),
           (args.top_k < 0, f"--top-k {args.top_k}: must not be negative (0 samples from every token)"),
           (not args.temperature > 0, f"--temperature {args.temperature}: must be positive"),
           (args.device not in C.DEVICES, f"unknown device '{args.device}'; use --device {' | '.join(C.DEVICES)}")]
    try:
        for is_bad, message in bad:
            if is_bad:
                raise C.ConfigError(message)
        device = launch.choose_device(args.device, 0, 1)
        model, tokenizer, cfg = load_model(Path(args.ckpt), device)
        stop = end_of_text_ids(Path(args.ckpt))
    except (C.ConfigError, launch.LaunchError, FileNotFoundError, ValueError) as e:
        print(f"meshtrain: error: {e}", file=sys.stderr)
        return 2
    prompt = tokenizer.encode_prompt(args.prompt)
    ids = sample(model, prompt, args.tokens, cfg.train.seq_len, temperature=args.temperature,
                 top_k=args.top_k, seed=args.seed, stop=stop)
    print(args.prompt + tokenizer.decode(ids[:-1] if ids and ids[-1] in stop else ids))  # the text, not its end
    return 0

"""Presets the tests add: `gpt-test-4`, gpt-test with 4 blocks instead of 8; `gpt-small-2`,
gpt-small with 2 blocks instead of 8.

The verify matrices check how a layout cuts and synchronises a model, which 4 blocks show as
well as 8 (a pp-2 stage still holds two blocks, an interleaved one two chunks; every tensor
kind is there), at about 60 % of the CPU (a 2-rank record: dp 0.55 → 0.40 s, tp 1.74 → 0.91 s,
pp 1.04 → 0.64 s). Layouts that need 8 blocks (pp 4 with two chunks a stage) keep gpt-test.
gpt-small-2 keeps gpt-small's large tensors (the 524,288-element head and embedding, whose
gradient norms an fp32 sum gets wrong by 1.3-1.6e-5 in its layouts as in gpt-small's:
test_verify_norm) at a third of its verify time.
Registered on import: by conftest in pytest's processes, by the fork server (distributed.PRELOAD)
in the tests' ranks."""

import dataclasses

from meshtrain.recipes import PRESETS, add_preset

GPT_TEST_4 = "gpt-test-4"
GPT_SMALL_2 = "gpt-small-2"

if GPT_TEST_4 not in PRESETS:
    add_preset(GPT_TEST_4, dataclasses.replace(PRESETS["gpt-test"], n_layers=4))
if GPT_SMALL_2 not in PRESETS:
    add_preset(GPT_SMALL_2, dataclasses.replace(PRESETS["gpt-small"], n_layers=2))

"""A preset the tests add: `gpt-test-4`, gpt-test with 4 blocks instead of 8.

The verify matrices check how a layout cuts and synchronises a model, which 4 blocks show as
well as 8 (a pp-2 stage still holds two blocks, an interleaved one two chunks; every tensor
kind is there), at about 60 % of the CPU (a 2-rank record: dp 0.55 → 0.40 s, tp 1.74 → 0.91 s,
pp 1.04 → 0.64 s). Layouts that need 8 blocks (pp 4 with two chunks a stage) keep gpt-test.
Registered on import: by conftest in pytest's processes, by the fork server (distributed.PRELOAD)
in the tests' ranks."""

import dataclasses

from meshtrain.recipes import PRESETS, add_preset

GPT_TEST_4 = "gpt-test-4"

if GPT_TEST_4 not in PRESETS:
    add_preset(GPT_TEST_4, dataclasses.replace(PRESETS["gpt-test"], n_layers=4))

import os
import sys
import tempfile

# Tests import their helpers (helpers.py, distributed.py) by module name; spawned ranks too.
sys.path.insert(0, os.path.dirname(__file__))
# Tests spawn many ranks on a small CPU: one thread each (child processes inherit this).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# A fresh data cache per session, as on a fresh machine (the byte-tokenized corpus takes ~0.1 s).
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="meshtrain-test-cache-")

import presets  # noqa: E402,F401  (the tests' own presets, gpt-test-4)


# Where the suite's time goes: MESHTRAIN_TEST_PROFILE=FILE appends one line per test to FILE
# (every xdist worker alike); `python tests/suite_profile.py FILE` prints the tables.
PROFILE_ENV = "MESHTRAIN_TEST_PROFILE"


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # xdist would hand out the files with the most tests first
        config.option.loadscopereorder = False  # in the order below instead (`pytest_collection_modifyitems`)
    if os.environ.get(PROFILE_ENV):
        from suite_profile import Profile
        config.pluginmanager.register(Profile(os.environ[PROFILE_ENV]), "suite_profile")


# The longest files first (measured: docs/tests.md). `make test` hands out whole files to two
# workers in this order; a long file handed out last keeps one worker busy while the other,
# done, waits. Within a file, and among the others, the order stays as collected.
LONGEST_FIRST = ["test_verify_mutants.py", "test_cli.py", "test_compile.py", "test_zero.py", "test_run_folder.py",
                 "test_pipeline.py", "test_expert_parallel.py", "test_examples.py", "test_checkpoint.py",
                 "test_recompute.py", "test_context.py", "test_layout_search.py", "test_tensor.py", "test_llama.py", "test_verify_norm.py",
                 "test_async_save.py", "test_plan_moe.py", "test_validation.py", "test_planner.py", "test_plan_llama.py",
                 "test_verify_resume.py", "test_prepare_scale.py", "test_plan_activations.py", "test_export_hf.py",
                 "test_padding_idx.py", "test_prepare_finetune.py", "test_moe.py",
                 "test_moe_hf.py"]  # then each under 18 s


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))

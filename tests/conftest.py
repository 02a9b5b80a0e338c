import os
import sys
import tempfile

# Tests import their helpers (helpers.py, distributed.py) by module name; spawned ranks too.
sys.path.insert(0, os.path.dirname(__file__))
# Tests spawn many ranks on a small CPU: one thread each (child processes inherit this).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# A fresh data cache per session, as on a fresh machine (the byte-tokenized corpus takes ~0.1 s).
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="meshtrain-test-cache-")


# Where the suite's time goes: MESHTRAIN_TEST_PROFILE=FILE appends one line per test to FILE
# (every xdist worker alike); `python tests/suite_profile.py FILE` prints the tables.
PROFILE_ENV = "MESHTRAIN_TEST_PROFILE"


def pytest_configure(config):
    if os.environ.get(PROFILE_ENV):
        from suite_profile import Profile
        config.pluginmanager.register(Profile(os.environ[PROFILE_ENV]), "suite_profile")

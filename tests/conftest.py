import os
import sys
import tempfile

# Tests import their helpers (helpers.py, distributed.py) by module name; spawned ranks too.
sys.path.insert(0, os.path.dirname(__file__))
# Tests spawn many ranks on a small CPU: one thread each (child processes inherit this).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# A fresh data cache per session, as on a fresh machine (the byte-tokenized corpus takes ~0.1 s).
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="meshtrain-test-cache-")


def pytest_addoption(parser):
    parser.addoption("--profile", metavar="FILE", help="append each test's wall time and fresh interpreters to FILE "
                     "(tests/suite_profile.py prints the tables)")


def pytest_configure(config):
    if config.getoption("--profile"):
        from suite_profile import Profile
        config.pluginmanager.register(Profile(config.getoption("--profile")), "suite_profile")

import os
import sys

# Tests import their helpers (helpers.py, distributed.py) by module name; spawned ranks too.
sys.path.insert(0, os.path.dirname(__file__))
# Tests spawn many ranks on a small CPU: one thread each (child processes inherit this).
os.environ.setdefault("OMP_NUM_THREADS", "1")

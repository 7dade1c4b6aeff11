"""Logs each Python process that starts with this folder on PYTHONPATH (see cpu_per_test.py)."""

import os
import sys
import time

try:
    _dir = os.environ.get("SUITE_PROFILE_DIR", "/tmp/suite-profile")
    os.makedirs(_dir, exist_ok=True)
    with open(os.path.join(_dir, "processes.txt"), "a") as _f:
        _f.write(f"{os.getpid()} {time.time():.2f} {' '.join(sys.argv)[:300]}\n")
except OSError:
    pass

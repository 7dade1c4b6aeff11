"""`python -m mlxd ...`: the `mlxd` command, for an environment without its script on PATH."""

import sys

from mlxd.cli import main

sys.exit(main())

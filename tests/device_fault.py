"""Run `mlxd.cli` with the device failing for good once a prompt holds token POISON (tests/test_device_lost.py).

`python tests/device_fault.py python -m mlxd.cli serve ...` (a ServeProcess launcher): every engine step from the
poisoned one on raises what a poisoned CUDA context raises, resets included, as on the H100 at 09:53 2026-12-07.
"""

from __future__ import annotations

import sys
from typing import Any

POISON = 7
FAULT = "cudaStreamSynchronize(free_streams_[i]) failed: an illegal memory access was encountered (injected)"


def install() -> None:
    """EngineCore.step fails from the first step that starts a poisoned prompt, and every step after it."""
    from mlxd.engine.core import EngineCore

    step = EngineCore.step

    def failing(self: Any, ops: Any) -> Any:
        if getattr(self, "_device_poisoned", False) or any(POISON in s.request.prompt for s in ops.starts):
            self._device_poisoned = True
            raise RuntimeError(FAULT)
        return step(self, ops)

    EngineCore.step = failing  # type: ignore[method-assign]


if __name__ == "__main__":
    argv = sys.argv[1:]
    at = argv.index("mlxd.cli")  # after "python -m"
    install()
    from mlxd.cli import main

    sys.exit(main(argv[at + 1:]))


def install_with(monkeypatch: Any) -> None:
    """`install` for one test (pytest's monkeypatch undoes it)."""
    from mlxd.engine.core import EngineCore

    monkeypatch.setattr(EngineCore, "step", EngineCore.step)  # restored at the test's end
    install()

"""A real `mlxd serve` child process for the reliability scripts (crash loop, load test).

Kept free of test-only imports so the scripts run on their own:
`with ServeProc(["--model", DIR, ...], log_path) as p: httpx.get(p.url + "/health")`.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

_URL = re.compile(r"mlxd: serving \S+ on (http://\S+)")


class ServeProc:
    def __init__(self, args: list[str], log_path: Path, *, env: dict[str, str] | None = None) -> None:
        self.args = [sys.executable, "-m", "mlxd.cli", "serve", "--port", "0", "--log-format", "json", *args]
        self.log_path = Path(log_path)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self._offset = 0

    def start(self, timeout: float = 120) -> ServeProc:
        self._offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=log, env=self.env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = _URL.search(self.log())
            if match:
                self.url = match.group(1).replace("0.0.0.0", "127.0.0.1")
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlxd serve exited {self.proc.returncode}:\n{self.log()[-4000:]}")
            time.sleep(0.02)
        raise TimeoutError(f"mlxd serve did not start:\n{self.log()[-4000:]}")

    def log(self) -> str:
        """This run's part of the log file (the file may hold earlier runs)."""
        with open(self.log_path, "rb") as f:
            f.seek(self._offset)
            return f.read().decode(errors="replace")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def signal(self, signum: int = signal.SIGTERM) -> None:
        assert self.proc is not None
        self.proc.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL and reap."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        self.wait(30)

    def wait(self, timeout: float = 60) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def __enter__(self) -> ServeProc:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()

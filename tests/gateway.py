"""Test helper: SMG (the Shepherd Model Gateway, `pip install smg`) as a real child process."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def smg_command() -> str:
    """The `smg` CLI next to this interpreter (the venv's), else on PATH."""
    here = Path(sys.executable).with_name("smg")
    found = str(here) if here.exists() else shutil.which("smg")
    assert found, "the smg gateway is not installed: scripts/bootstrap --test installs it"
    return found


class Gateway:
    """`with Gateway(urls, policy=..., log_path=...) as gw:` runs `smg launch` in front of `urls`."""

    def __init__(self, worker_urls: list[str], *, policy: str, log_path: Path, extra: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workers = list(worker_urls)
        self.args = [
            smg_command(), "launch", "--host", "127.0.0.1", "--port", str(self.port),
            "--policy", policy, "--worker-urls", *worker_urls,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--log-level", "info", *extra,
        ]
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60) -> Gateway:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=self._log)
        deadline = time.monotonic() + timeout
        with httpx.Client(base_url=self.url, timeout=5) as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"smg exited {self.proc.returncode}:\n{self.log()}")
                try:
                    r = http.get("/readiness")
                    if r.status_code == 200 and r.json().get("healthy_workers") == len(self.workers):
                        return self
                except (httpx.HTTPError, ValueError):
                    pass
                time.sleep(0.2)
        raise TimeoutError(f"smg did not become ready:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        if not self._log.closed:
            self._log.close()

    def __enter__(self) -> Gateway:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

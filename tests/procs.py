"""Test helper: `mlxd serve` as a real child process on a free loopback port."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx


class ServeProcess:
    """`with ServeProcess(args) as p:` runs `mlxd serve --port 0 ...` and finds its URL.

    `launcher` runs it under a launcher (e.g. `mlx.launch ... --`), in a
    process group of its own, so that cleanup reaches every process it started.
    """

    def __init__(self, *args: str, log_path: Path, launcher: Sequence[str] = (),
                 env: Mapping[str, str] | None = None) -> None:
        self.launcher = list(launcher)
        self.env = dict(env or {})  # added to this process's environment (the experimental switches)
        probe = () if "--device-probe" in args else ("--device-probe", "off")  # see serving.config_for
        self.args = [*self.launcher, sys.executable, "-m", "mlxd.cli", "serve", "--port", "0",
                     "--log-format", "json", *probe, *args]
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self, timeout: float = 120) -> ServeProcess:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in wait()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        # stdin: a pipe nobody writes, as a terminal would be (mlx.launch relays its
        # stdin to the ranks, re-reading one at end of file without pause).
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=self._log, env=env,
                                     stdin=subprocess.PIPE if self.launcher else None,
                                     start_new_session=bool(self.launcher))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = re.search(r"mlxd: serving \S+ on (http://\S+)", self.log_path.read_text(errors="replace"))
            if match:
                self.url = match.group(1)
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlxd serve {exit_status(self.proc.returncode)}:\n{self.log()}")
            time.sleep(0.05)
        raise TimeoutError(f"mlxd serve did not start:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def post_mortem(self, returncode: int | None, lines: int = 150) -> str:
        """How the server ended (or that it still ran) and its log's last lines, for a failed test."""
        if returncode is None:
            status = "was still running when the test failed (its threads' stacks: SIGUSR1, below)"
        else:
            status = exit_status(returncode)
        tail = self.log().splitlines()[-lines:]
        return f"mlxd serve (pid {self.proc.pid if self.proc else None}) {status}; its log's last lines:\n" + "\n".join(tail)

    def wait_for_log(self, text: str, timeout: float = 60) -> None:
        """Until `text` appears in the server's log (a state it reached, not a guessed sleep)."""
        deadline = time.monotonic() + timeout
        while text not in self.log():
            assert time.monotonic() < deadline, f"{text!r} not in the log after {timeout} s"
            time.sleep(0.02)

    def signal(self, signum: int = signal.SIGTERM) -> None:
        assert self.proc is not None
        self.proc.send_signal(signum)

    def wait(self, timeout: float = 60) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._log.close()

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120)

    def __enter__(self) -> ServeProcess:
        return self.start()

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is not None and self.proc is not None and not self.launcher:
            # The test failed: say whether the server died (its exit status, a signal's name) or still
            # runs (then its threads' stacks first: `mlxd serve` dumps them on SIGUSR1), with its log.
            returncode = self.proc.poll()
            if returncode is None:
                self.proc.send_signal(signal.SIGUSR1)
                deadline = time.monotonic() + 10  # written by a C handler as soon as the process runs
                while "most recent call first" not in self.log() and time.monotonic() < deadline:
                    time.sleep(0.05)
                time.sleep(0.2)  # the other threads' stacks follow the first
            exc.add_note(self.post_mortem(returncode))
        if self.proc is not None and self.launcher:
            try:  # the ranks too, not only the launcher
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        if not self._log.closed:
            self._log.close()


def exit_status(returncode: int) -> str:
    """`exited 1`, or `killed by SIGKILL (-9)` for a negative Popen returncode."""
    if returncode >= 0:
        return f"exited {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"killed by {name} ({returncode})"


def kill_mid_request(proc: ServeProcess, path: str, body: dict, *, checkpoints: int = 2) -> None:
    """Send `body` to `path`, SIGKILL the server once it wrote `checkpoints` generation checkpoints.

    Asserts the request was cut by the kill (it never answered).
    """
    import threading

    cut: dict[str, object] = {}

    def doomed() -> None:
        try:
            with proc.client() as h:
                cut["reply"] = h.post(path, json=body)
        except httpx.HTTPError as exc:
            cut["error"] = exc

    worker = threading.Thread(target=doomed)
    worker.start()
    with proc.client() as http:
        deadline = time.monotonic() + 60
        while http.get("/stats").json()["generation_checkpoints"]["written"] < checkpoints:
            assert time.monotonic() < deadline, "no checkpoint was written"
            time.sleep(0.01)
    proc.signal(signal.SIGKILL)
    proc.wait()
    worker.join(timeout=60)
    assert "error" in cut, "the request must have been cut by the kill"

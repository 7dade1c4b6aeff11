"""Test helper: `mlxd serve` as a real process on a free loopback port (started, or forked from a zygote)."""

from __future__ import annotations

import atexit
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

forked_cpu_s = 0.0  # the CPU of the forked servers that ended (benchmarks/suite_profile counts it as a test's)


class Forked:
    """A server forked by a `Zygote`: what `ServeProcess` uses of `subprocess.Popen` (it is not our child,
    so its exit code comes from the zygote, through a file)."""

    def __init__(self, pid: int, exit_path: Path) -> None:
        self.pid = pid
        self.exit_path = exit_path
        self.returncode: int | None = None

    def poll(self) -> int | None:
        global forked_cpu_s
        if self.returncode is None and self.exit_path.exists():
            code, cpu = self.exit_path.read_text().split()
            self.returncode, forked_cpu_s = int(code), forked_cpu_s + float(cpu)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"mlxd serve (pid {self.pid})", timeout or 0)
            time.sleep(0.01)
        return code

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Zygote:
    """tests/serve_zygote.py, started once with an environment: forks `mlxd serve`s that skip the imports."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = dict(env)
        script = Path(__file__).with_name("serve_zygote.py")
        self.errors = tempfile.TemporaryFile()  # noqa: SIM115 - its own stderr, for a zygote that died
        self.proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.errors, env=self.env)
        self.lock = threading.Lock()
        self.read: frozenset[str] | None = None  # the names read at import (the zygote's first line)
        atexit.register(self.close)

    def close(self) -> None:
        """End the zygote (its stdin's end) and wait for it: its CPU, and that of the servers it forked and
        reaped, then counts as this process's children's (`RUSAGE_CHILDREN`, benchmarks/bench_suite_cpu.py)."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def can_fork(self, env: Mapping[str, str]) -> bool:
        """Whether a server of `env` can be forked: it differs from the zygote's only in `MLXD_` names that
        were not read while the zygote imported."""
        return not self.in_the_way(env)

    def in_the_way(self, env: Mapping[str, str]) -> list[str]:
        """The names `env` differs from the zygote's in that a fork cannot take: any but `MLXD_` ones, and those
        read while the zygote imported."""
        with self.lock:
            if self.read is None:
                self.read = frozenset(json.loads(self._reply())["read"])
        differ = {k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k)}
        differ.discard("PYTEST_CURRENT_TEST")  # pytest's, set for each test (the child gets the test's)
        return sorted(k for k in differ if not k.startswith("MLXD_") or k in self.read)

    def _reply(self) -> bytes:
        assert self.proc.stdout is not None
        reply = self.proc.stdout.readline()
        if not reply:
            self.errors.seek(0)
            raise RuntimeError(f"the serve zygote exited {self.proc.wait(10)}:\n{self.errors.read().decode()}")
        return reply

    def fork(self, argv: Sequence[str], env: Mapping[str, str], log_path: Path) -> Forked:
        exit_path = log_path.with_name(f".{log_path.name}.{time.monotonic_ns()}.exit")
        request = {"argv": list(argv), "env": dict(env), "log": str(log_path), "exit": str(exit_path)}
        with self.lock:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
            reply = self._reply()
        return Forked(json.loads(reply)["pid"], exit_path)


_zygotes: list[Zygote] = []
MAX_ZYGOTES = 3  # per test process: its environment as it was, and as a test or a library changed it since


def zygote_for(env: Mapping[str, str]) -> Zygote | None:
    """A zygote of this test process that can fork a server of `env` (`Zygote.can_fork`); None where none can
    (the server is started afresh) or MLXD_TEST_FORK=0. Where none of the live ones can and this process's
    environment is not one of theirs (a zygote started while a test had changed it, or before a library set a
    name of its own), another is started with the environment as it is now: one started under another
    environment must not leave every later server unforked. Zygotes are never ended early: the servers they
    forked report their exit through them."""
    if os.environ.get("MLXD_TEST_FORK", "1") == "0":
        return None
    _zygotes[:] = [z for z in _zygotes if z.proc.poll() is None]
    for zygote in _zygotes:
        if zygote.can_fork(env):
            return zygote
    now = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if len(_zygotes) >= MAX_ZYGOTES or any(_same_environment(z.env, now) for z in _zygotes):
        return None
    zygote = Zygote(now)
    _zygotes.append(zygote)
    return zygote if zygote.can_fork(env) else None


def unforkable(env: Mapping[str, str]) -> list[list[str]]:
    """For each live zygote, the names in the way of forking a server of `env` (for a failed test)."""
    return [zygote.in_the_way(env) for zygote in _zygotes]


def _same_environment(a: Mapping[str, str], b: Mapping[str, str]) -> bool:
    ignored = {"PYTEST_CURRENT_TEST"}  # pytest's, set for each test
    return {k: v for k, v in a.items() if k not in ignored} == {k: v for k, v in b.items() if k not in ignored}


class ServeProcess:
    """`with ServeProcess(args) as p:` runs `mlxd serve --port 0 ...` and finds its URL.

    `launcher` runs it under a launcher (e.g. `mlx.launch ... --`), in a
    process group of its own, so that cleanup reaches every process it started.
    `fork`: fork it from this process's zygote (tests/serve_zygote.py: the same `mlxd.cli.main` in a real
    process, without its ~2 s of imports) where `Zygote.can_fork` its environment; False, or a `launcher`:
    always `python -m mlxd.cli`.
    """

    def __init__(self, *args: str, log_path: Path, launcher: Sequence[str] = (),
                 env: Mapping[str, str] | None = None, fork: bool = True) -> None:
        self.launcher = list(launcher)
        self.env = dict(env or {})  # added to this process's environment (the experimental switches)
        probe = () if "--device-probe" in args else ("--device-probe", "off")  # see serving.config_for
        self.cli_args = ["serve", "--port", "0", "--log-format", "json", *probe, *args]
        self.args = [*self.launcher, sys.executable, "-m", "mlxd.cli", *self.cli_args]
        self.fork = fork and not self.launcher
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | Forked | None = None
        self.url = ""

    def start(self, timeout: float = 120) -> ServeProcess:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in wait()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        zygote = zygote_for(env) if self.fork else None
        if zygote is not None:
            self.proc = zygote.fork(self.cli_args, env, self.log_path)
        else:
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

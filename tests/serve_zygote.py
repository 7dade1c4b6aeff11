"""A test helper process: `mlxd serve` forked from an interpreter that has already imported it.

Starting `python -m mlxd.cli serve` spends ~2.3 s of CPU importing (MLX, mlx-lm, `transformers`' scan of its
model files, Quart), nearly all of a tiny test server's start; the suite starts a hundred of them. This
process imports what `mlxd serve` imports, once, then forks a server per request: each child is a real
process that runs `mlxd.cli.main` with its own argv, its stdout and stderr on its own log, and exits through
the interpreter's normal end, as `python -m mlxd.cli` would; only the imports are shared.

Nothing here runs MLX (no array is evaluated): MLX starts its CPU stream's thread on first use, and a fork
keeps only the forking thread. Modules read some switches at import, and MLX and OpenBLAS read theirs in C:
`procs.ServeProcess` forks from a zygote only a server whose environment differs from the zygote's in
`MLXD_` names that were not read while it imported.

Protocol, one JSON object a line: first `{"read": [NAME, ...]}` on stdout, the environment's names read
(through `os.environ`) while importing; then `{"argv": [...], "env": {...}, "log": PATH, "exit": PATH}` on stdin,
`{"pid": N}` on stdout once forked (the child's `os.environ` is "env"). When a child ends, its exit code
(negative: the signal that ended it, as `subprocess.Popen.returncode`) and the CPU seconds it used are written
to its "exit" path (atomically). End of stdin: this process ends; children still running go on (their owners
kill them).
"""

from __future__ import annotations

import json
import os
import select
import sys


def preload() -> list[str]:
    """Import what `mlxd serve` imports; return the environment's names read meanwhile (through
    `os.environ`: a switch read at import must be the same in every child)."""
    read: set[str] = set()
    environ = type(os.environ)
    getitem = environ.__getitem__

    def recorded(self: os._Environ[str], key: str) -> str:
        read.add(key)
        return getitem(self, key)

    environ.__getitem__ = recorded  # type: ignore[method-assign]
    try:
        import mlx_lm  # noqa: F401
        from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: F401  (lazy attributes)

        import mlxd.actors.engine  # noqa: F401
        import mlxd.cli  # noqa: F401
        import mlxd.http.app  # noqa: F401
    finally:
        environ.__getitem__ = getitem  # type: ignore[method-assign]
    return sorted(read)


def reap(exits: dict[int, str]) -> None:
    while exits:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = exits.pop(pid, None)
        if path is not None:
            tmp = f"{path}.tmp"
            with open(tmp, "w") as f:
                f.write(f"{os.waitstatus_to_exitcode(status)} {usage.ru_utime + usage.ru_stime}")
            os.replace(tmp, path)


def serve_requests(read: list[str]) -> list[str] | None:
    """Fork a child per request; in the child, return its argv (the caller runs it), here None at EOF."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    replies.write(json.dumps({"read": read}) + "\n")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 1)  # a stray print must not reach the replies
    exits: dict[int, str] = {}
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.01 if exits else None)  # idle: sleep until asked
        reap(exits)
        if not readable:
            continue
        data = os.read(0, 65536)
        if not data:
            return None
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                replies.close()
                log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                os.dup2(log, 1)
                os.dup2(log, 2)
                os.dup2(null, 0)
                os.close(log)
                os.close(null)
                os.environ.clear()
                os.environ.update(request["env"])
                return list(request["argv"])
            exits[pid] = request["exit"]
            replies.write(json.dumps({"pid": pid}) + "\n")


if __name__ == "__main__":
    argv = serve_requests(preload())
    if argv is None:
        sys.exit(0)
    import mlxd.cli

    sys.argv = [mlxd.cli.__file__, *argv]
    sys.exit(mlxd.cli.main(argv))

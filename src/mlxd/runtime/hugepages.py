"""Back large MLX allocations with transparent huge pages (Linux, glibc).

MLX's CPU allocator keeps no buffer cache on Linux: every array is a fresh
``malloc`` and every free goes back to glibc, which returns large blocks
(over 32 MiB) to the kernel with ``munmap``.  So each large array, a restored
KV cache or the copy that merges it into a batch, is page-faulted in 4 KiB at
a time: on these VMs about 2 GB/s, 65 ms for a 133 MB copy.  The kernel
default here is ``transparent_hugepage=madvise``; glibc's
``glibc.malloc.hugetlb=1`` tunable makes malloc ``madvise(MADV_HUGEPAGE)``
its mappings, and the same copy runs in about 13 ms (``benchmarks/bench_alloc.py``).

glibc reads tunables once, at process start, so ``mlxd serve`` re-executes
itself (same pid, same arguments) with the tunable added to
``GLIBC_TUNABLES``.  ``MLXD_HUGEPAGES=0`` opts out; embedding programs set
``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` themselves.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb"
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(path: Path = _THP_MODE) -> str | None:
    """The kernel's transparent-huge-page mode (always, madvise, never), or None if unknown."""
    try:
        text = path.read_text()
    except OSError:
        return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def enabled(env: Mapping[str, str]) -> bool:
    """Whether this process was started with the huge-page malloc tunable."""
    for item in env.get("GLIBC_TUNABLES", "").split(":"):
        name, _, value = item.partition("=")
        if name == TUNABLE:
            return value not in ("", "0")
    return False


def reexec_env(env: Mapping[str, str], *, mode: str | None, libc: tuple[str, str]) -> dict[str, str] | None:
    """The environment to re-execute with, or None when there is nothing to gain.

    Nothing to gain: opted out, not glibc >= 2.35 (the first with the tunable),
    huge pages off (or already on for every mapping), or the tunable already set.
    """
    if env.get("MLXD_HUGEPAGES", "1") == "0" or mode != "madvise":
        return None
    name, version = libc
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError:
        return None
    if name != "glibc" or (major, minor) < (2, 35):
        return None
    existing = env.get("GLIBC_TUNABLES", "")
    if any(item.partition("=")[0] == TUNABLE for item in existing.split(":") if item):
        return None  # the user chose a value; keep it
    out = dict(env)
    out["GLIBC_TUNABLES"] = f"{existing}:{TUNABLE}=1" if existing else f"{TUNABLE}=1"
    return out


def status() -> dict[str, object]:
    """For /stats and the startup log."""
    return {"malloc_hugetlb": enabled(os.environ), "thp_mode": thp_mode()}


def reexec_if_useful() -> None:
    """Replace this process with itself plus the tunable (no return) when that helps."""
    if not sys.platform.startswith("linux"):
        return
    env = reexec_env(os.environ, mode=thp_mode(), libc=platform.libc_ver())
    if env is None:
        return
    argv = [sys.executable, *sys.orig_argv[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, argv, env)
    except OSError:
        return  # cannot exec (unusual sandbox): run on, with 4 KiB pages

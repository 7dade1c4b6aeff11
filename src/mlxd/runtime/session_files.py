"""A session's KV as a verified `.mlxkv` file: export it, import it into another server.

Export writes the session's latest checkpoint (from RAM, else from its SSD
file) as one whole `.mlxkv` file (docs/file-format.md): the same hashed
header and per-tensor CRC-32 as the SSD tier's files, so the receiving
server checks every byte. Import reads an uploaded file with every check on,
refuses it unless it was computed by this very model, tokenizer and KV scheme
(the store identity) and its caches fit this model (kinds, token counts, one
forward token on a copy), then adopts it into the tiers: the file itself
moves into the SSD tier when there is one (a rename: it is already a valid
cache file), and its caches go to RAM under the session. A refused file
changes nothing.

The MLX work runs on the engine's thread (`EngineActor.plan_checkpoint`,
`adopt_checkpoint`); file I/O on worker threads.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import trio

from mlxd.kv import file_format as ff
from mlxd.kv.media import MEDIA_BASE
from mlxd.kv.ssd_store import SsdStore, StoreIdentity, namespace_dir, payload_bytes
from mlxd.kv.tiers import SessionCheckpoint, SsdRecord
from mlxd.runtime.logging import get_logger

log = get_logger("mlxd.sessions")

UPLOAD_SUFFIX = ".upload"
STALE_TRANSFER_S = 3600.0  # a transfer file this old belongs to no live transfer (another replica's included)
_swept: set[Path] = set()


class ImportRefused(Exception):
    """The uploaded file cannot be adopted; `status` 400 (not a valid file) or 409 (another model's KV)."""

    def __init__(self, status: int, message: str, *, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@attrs.frozen
class Imported:
    """What an import adopted: the checkpoint's tokens, and which tiers hold it now."""

    tokens: int
    namespace: str
    nbytes: int
    ram: bool
    ssd: bool


def import_limit(*, max_context: int, kv_bytes_per_token: int, slack: int) -> int:
    """The largest upload worth reading: twice the KV of a full context plus `slack` (headers,
    page padding, fixed-size recurrent state); a larger file cannot be a checkpoint of this model."""
    return 2 * max_context * kv_bytes_per_token + 16 * max_context + slack


def transfer_dir(store: SsdStore | None) -> Path:
    """Where exports are written and uploads received: beside the SSD tier (the same filesystem, so
    an imported file moves in by a rename), else the system's temporary directory."""
    import tempfile

    base = store.root / "transfers" if store is not None else Path(tempfile.gettempdir()) / "mlxd-transfers"
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    if base not in _swept:  # a crash mid-transfer leaves its file: the first use in a process removes old ones
        _swept.add(base)
        cutoff = time.time() - STALE_TRANSFER_S
        for leftover in base.iterdir():
            try:
                if leftover.is_file() and not leftover.is_symlink() and leftover.stat().st_mtime < cutoff:
                    leftover.unlink()
            except OSError:
                pass
    return base


def new_upload_path(directory: Path) -> Path:
    return directory / (uuid.uuid4().hex + UPLOAD_SUFFIX)


async def export_checkpoint(
    found: SessionCheckpoint,
    namespace: str,
    *,
    engine: Any,
    store: SsdStore | None,
    identity: StoreIdentity,
    directory: Path,
    lost: Callable[[SsdRecord], Awaitable[None]],
) -> Path | None:
    """Write the checkpoint as a whole `.mlxkv` file in `directory`; None when its SSD file was unreadable."""
    n = len(found.tokens)
    meta = identity.meta(found.tokens, namespace)
    if found.entry is not None:
        plan = await engine.plan_checkpoint(found.entry.payload, n, len(found.entry.tokens), meta)
    else:
        record = found.record
        assert record is not None and store is not None
        loaded = await trio.to_thread.run_sync(store.load, record)
        if loaded is None:
            await lost(record)
            return None
        caches, _, _ = await engine.adopt_checkpoint(loaded)
        del loaded
        plan = await engine.plan_checkpoint(caches, n, len(record.tokens), meta)
    path = directory / (uuid.uuid4().hex + ff.EXTENSION)
    await trio.to_thread.run_sync(lambda: ff.write_snapshot(plan, path, direct=False))
    return path


def _read_checked(
    path: Path, identity: StoreIdentity, *, vocab: int, max_context: int, namespaces: frozenset[str]
) -> ff.LoadedSnapshot:
    """(worker thread) Read the upload with every check on; ImportRefused says what is wrong."""
    try:
        loaded = ff.read_snapshot(path, verify=True)
    except ff.UnsupportedVersion as exc:
        raise ImportRefused(400, f"not a readable .mlxkv file: {exc}", code="unsupported_kv_format") from None
    except ff.StorageError as exc:
        raise ImportRefused(400, f"not a valid .mlxkv file: {exc}", code="invalid_kv_file") from None
    meta = loaded.header.meta
    problem = identity.mismatch(meta, namespace_dir(meta.namespace))
    if problem is not None:
        raise ImportRefused(409, f"the file's KV was computed by another model, tokenizer or KV scheme ({problem}); "
                            "it can only be imported into a server of the same model and settings",
                            code="kv_identity_mismatch")
    if meta.namespace not in namespaces:  # the base model's, or an adapter's this server loaded
        raise ImportRefused(409, f"the file's namespace {meta.namespace!r} (an adapter) is not served here",
                            code="kv_identity_mismatch")
    tokens = loaded.header.tokens
    if not 1 <= len(tokens) <= max_context:
        raise ImportRefused(400, f"the file holds {len(tokens)} tokens; this model takes 1 to {max_context}",
                            code="invalid_kv_file")
    if any(not (0 <= t < vocab or MEDIA_BASE <= t < 2**31) for t in tokens):
        raise ImportRefused(400, f"the file's token ids must be in [0, {vocab})", code="invalid_kv_file")
    return loaded


def _move_in(path: Path, store: SsdStore, header: ff.FileHeader) -> SsdRecord:
    """(worker thread) The verified upload becomes an SSD-tier file (rename, then fsync the directory)."""
    dest = store.reserve_path(header.namespace)
    os.chmod(path, 0o600)
    os.replace(path, dest)
    ff.fsync_dir(dest.parent)
    now = time.time()
    os.utime(dest, (now, now))  # the LRU clock: just used
    return SsdRecord(header.namespace, header.tokens, payload_bytes(header), now, header.trimmable, dest)


async def import_file(
    path: Path,
    session: str,
    *,
    engine: Any,
    store: SsdStore | None,
    identity: StoreIdentity,
    vocab: int,
    max_context: int,
    adopt: Callable[[ff.FileHeader, list[object], int, bool, SsdRecord | None], Awaitable[bool]],
    namespaces: frozenset[str] = frozenset({""}),
) -> Imported:
    """Verify an uploaded file and adopt it into the tiers; ImportRefused leaves the cache unchanged."""
    loaded = await trio.to_thread.run_sync(
        lambda: _read_checked(path, identity, vocab=vocab, max_context=max_context, namespaces=namespaces)
    )
    header = loaded.header
    try:
        caches, nbytes, trimmable = await engine.adopt_checkpoint(loaded)
    except ValueError as exc:
        raise ImportRefused(400, f"the file's caches do not fit this model: {exc}", code="invalid_kv_file") from None
    finally:
        del loaded
    record = None
    if store is not None:
        try:
            record = await trio.to_thread.run_sync(_move_in, path, store, header)
        except (OSError, ff.StorageError) as exc:  # RAM still takes it: a full disk costs the restart only
            log.warning("session_import.ssd_failed", error=str(exc))
    in_ram = await adopt(header, caches, nbytes, trimmable, record)
    log.info("session_import.adopted", session=session, tokens=len(header.tokens), nbytes=nbytes, ram=in_ram,
             ssd=record is not None)
    return Imported(len(header.tokens), header.namespace, nbytes, in_ram, record is not None)

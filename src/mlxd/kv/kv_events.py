"""KV cache events in vLLM's wire format, so fleet routers and indexers can track mlxd.

mlxd caches whole prefixes (one entry = the state after exactly these tokens),
not fixed pages. For the outside world it announces them as vLLM does its
pages: a prefix covers `len(tokens) // block_size` logical blocks, each named by
the block store's chained hash (`mlxd.kv.blocks.chain_hash`: the model's config
fingerprint, the namespace, the parent's name, the tokens) as a 63-bit int
(`blocks.event_hash`), so with `block_size` equal to the store's span the
events and the SSD directory name the same blocks. A block is "stored" on a medium (RAM, SSD) while at least one entry
on that medium covers it, and "removed" when the last such entry goes; a
`ResidencyLedger` turns the set of resident entries into exactly those events.

Wire format (vLLM `vllm/distributed/kv_events.py`, msgspec structs with
`array_like=True, omit_defaults=True, tag=True`): each ZMQ PUB message is
`[topic, seq (8 bytes big-endian), msgpack(batch)]` with

    batch            = [ts, [event, ...]]
    BlockStored      = ["BlockStored", block_hashes, parent_block_hash, token_ids,
                        block_size, lora_id, medium, lora_name]
    BlockRemoved     = ["BlockRemoved", block_hashes, medium]
    AllBlocksCleared = ["AllBlocksCleared"]

Token ids are left out (`token_ids` is `[]`) unless the operator asks for
them: the block hashes alone name what a replica holds, while the ids are the
prompts themselves (SECURITY.md). `PublishAddress.of` decides where events go:
a wildcard host binds loopback unless every interface is allowed.

Pure: no trio, no sockets (`actors/kv_publisher.py` sends the batches).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import numpy as np

from mlxd.kv import blocks as bk

RAM = "RAM"
SSD = "SSD"
CPU = "CPU"  # the host-memory tier (--host-cache-gb), vLLM's name for host-offloaded blocks
DEFAULT_BLOCK_SIZE = 16


def block_hashes(tokens: Sequence[int] | np.ndarray, namespace: str = "", *,
                 block_size: int = DEFAULT_BLOCK_SIZE, fingerprint: str = "") -> list[int]:
    """The event hashes of every full block of `tokens` (a partial last block has none).

    `fingerprint` is the store identity's (`StoreIdentity.fingerprint`): the
    server passes it, so a replica's events name the blocks of its SSD store.
    """
    names = bk.grid_names(tokens, block_tokens=block_size, namespace=namespace, fingerprint=fingerprint)
    return [bk.event_hash(n) for n in names]


@attrs.frozen
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str

    def wire(self) -> list[Any]:
        return ["BlockStored", list(self.block_hashes), self.parent_block_hash, list(self.token_ids),
                self.block_size, None, self.medium, None]


@attrs.frozen
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str

    def wire(self) -> list[Any]:
        return ["BlockRemoved", list(self.block_hashes), self.medium]


@attrs.frozen
class AllBlocksCleared:
    def wire(self) -> list[Any]:
        return ["AllBlocksCleared"]


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


def without_token_ids(events: Sequence[KvEvent]) -> list[KvEvent]:
    """The same events with every `BlockStored.token_ids` emptied (hashes, parents and sizes kept)."""
    return [attrs.evolve(e, token_ids=()) if isinstance(e, BlockStored) else e for e in events]


def encode_batch(ts: float, events: Sequence[KvEvent]) -> bytes:
    """msgpack of vLLM's `KVEventBatch` (array-like layout)."""
    import msgpack

    return msgpack.packb([ts, [e.wire() for e in events]], use_bin_type=True)


LOOPBACK = "127.0.0.1"
# Hosts that mean "every interface" to ZMQ's bind.
_WILDCARDS = ("*", "0.0.0.0", "::", "[::]")


@attrs.frozen
class PublishAddress:
    """Where the publisher's ZMQ PUB socket goes: `bind` it (subscribers connect) or connect it."""

    url: str
    bind: bool
    every_interface: bool = False

    @classmethod
    def of(cls, endpoint: str, *, all_interfaces: bool = False) -> PublishAddress:
        """vLLM's rule (a wildcard host or `ipc://` binds, any other host is connected to), made
        safe: `tcp://*:PORT` binds 127.0.0.1 unless `all_interfaces`; an explicit all-interfaces
        host (`0.0.0.0`, `::`) without `all_interfaces` is refused (ValueError)."""
        if endpoint.startswith(("ipc://", "inproc://")):
            return cls(endpoint, bind=True)
        if not endpoint.startswith("tcp://"):
            raise ValueError(f"kv-events endpoint {endpoint!r}: expected tcp://HOST:PORT (or ipc://PATH)")
        host, sep, port = endpoint.removeprefix("tcp://").rpartition(":")
        if not sep or not host or not port:
            raise ValueError(f"kv-events endpoint {endpoint!r}: expected tcp://HOST:PORT (or ipc://PATH)")
        if host not in _WILDCARDS:
            return cls(endpoint, bind=False)
        if all_interfaces:
            return cls(endpoint, bind=True, every_interface=True)
        if host == "*":
            return cls(f"tcp://{LOOPBACK}:{port}", bind=True)
        raise ValueError(
            f"kv-events endpoint {endpoint!r} binds every network interface, and anyone who reaches the port "
            f"reads which prompts this server caches (and the prompts, with token ids on): use tcp://*:{port} "
            "to bind loopback only, or allow every interface with --kv-events-all-interfaces "
            "(RuntimeConfig.kv_events_all_interfaces); see SECURITY.md"
        )


def decode_batch(payload: bytes) -> tuple[float, list[KvEvent]]:
    """The inverse of `encode_batch` (for tools and tests; vLLM subscribers decode it too)."""
    import msgpack

    ts, raw, *_ = msgpack.unpackb(payload, raw=False)
    events: list[KvEvent] = []
    for item in raw:
        kind = item[0]
        if kind == "BlockStored":
            events.append(BlockStored(tuple(item[1]), item[2], tuple(item[3]), item[4], item[6]))
        elif kind == "BlockRemoved":
            events.append(BlockRemoved(tuple(item[1]), item[2]))
        elif kind == "AllBlocksCleared":
            events.append(AllBlocksCleared())
        else:
            raise ValueError(f"unknown KV event {kind!r}")
    return ts, events


@attrs.define
class _Resident:
    ref: Any  # the entry object itself: its identity is the key
    hashes: list[int]


@attrs.define
class ResidencyLedger:
    """Turns "these entries are resident on this medium now" into stored/removed block events.

    `sync(medium, entries)` is called with every resident entry (objects with
    `.namespace` and `.tokens`); it compares them by identity with the last
    call, so only new entries are hashed.
    """

    block_size: int = DEFAULT_BLOCK_SIZE
    fingerprint: str = ""
    _entries: dict[str, dict[int, _Resident]] = attrs.Factory(dict)
    _counts: dict[str, dict[int, int]] = attrs.Factory(dict)

    def sync(self, medium: str, entries: Iterable[Any]) -> list[KvEvent]:
        known = self._entries.setdefault(medium, {})
        counts = self._counts.setdefault(medium, {})
        current = {id(e): e for e in entries}
        events: list[KvEvent] = []
        gone: list[int] = []
        for key, resident in list(known.items()):
            if current.get(key) is not resident.ref:
                del known[key]
                gone.extend(resident.hashes)
        for key, entry in current.items():
            if key in known:
                continue
            tokens = entry.tokens
            hashes = block_hashes(tokens, entry.namespace, block_size=self.block_size, fingerprint=self.fingerprint)
            known[key] = _Resident(entry, hashes)
            events.extend(self._stored(medium, counts, tokens, hashes))
        removed = []
        for h in gone:
            counts[h] -= 1
            if counts[h] == 0:
                del counts[h]
                removed.append(h)
        if removed:
            # Removals first: an entry replaced by a longer one keeps its shared blocks.
            events.insert(0, BlockRemoved(tuple(removed), medium))
        return events

    def _stored(self, medium: str, counts: dict[int, int], tokens: Any, hashes: list[int]) -> list[KvEvent]:
        """One BlockStored per run of blocks new on this medium (with its parent's hash)."""
        out: list[KvEvent] = []
        run: list[int] = []
        run_start = 0
        for i, h in enumerate(hashes):
            counts[h] = counts.get(h, 0) + 1
            if counts[h] == 1:
                if not run:
                    run_start = i
                run.append(h)
            elif run:
                out.append(self._event(medium, tokens, hashes, run_start, run))
                run = []
        if run:
            out.append(self._event(medium, tokens, hashes, run_start, run))
        return out

    def _event(self, medium: str, tokens: Any, hashes: list[int], start: int, run: list[int]) -> BlockStored:
        bs = self.block_size
        span = tokens[start * bs:(start + len(run)) * bs]
        parent = hashes[start - 1] if start > 0 else None
        return BlockStored(tuple(run), parent, tuple(int(t) for t in span), bs, medium)

    def blocks(self, medium: str) -> set[int]:
        """Block hashes resident on `medium` now."""
        return set(self._counts.get(medium, {}))

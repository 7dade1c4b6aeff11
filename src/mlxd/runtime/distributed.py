"""Serving one model sharded over several processes with MLX's distributed runtime.

`mlx.launch` starts one `mlxd serve --distributed` per rank. Each loads the
model and shards it with mlx-lm's own tensor parallelism (`model.shard(group)`:
attention heads and MLP columns split across ranks, partial results summed by
`all_sum` inside the forward pass). Rank 0 is the server: HTTP, scheduler,
engine, cache owner. The other ranks are followers: they run no HTTP and no
cache owner, only the engine's step function, fed by rank 0.

Every forward pass is a collective, so all ranks must run the same sequence of
`BatchGenerator` operations (insert the same prompts with the same samplers,
remove the same rows, `next()`), in the same order. Before each step rank 0
sends the step's inputs (`engine.ops.StepOps`: the requests that join, the
rows cancelled or stopped, the cached prefixes lent and dropped) to every
follower (`StepChannel`), and every follower drives its own `EngineCore`
with them (engine/ranks.py). Sampling is the same on every rank: the logits after the last `all_sum` are equal, greedy
rows take their argmax, and a sampling row's seed is fixed by rank 0 before
the broadcast (`pin_seed`).

The prompt cache's RAM tier is mirrored (kv/shard_mirror.py): rank 0's cache
owner decides everything, and each follower keeps its own KV shard of every
prefix rank 0 holds. The followers' engines take the same checkpoints in the
same steps as rank 0's, and keep each under `shard_key(namespace, tokens)`.
A start names the key of the prefix it lends (`StepOps.prefixes`), and a step
carries the keys rank 0's cache owner dropped since the last (`StepOps.drops`,
at most `MAX_DROPS_PER_STEP`). Before a step that lends prefixes every
follower says how many it lacks (`confirm` / `gather_missing`); any missing
one fails the step on rank 0, which then resets every rank: a follower never
starts a row from another prefix than rank 0's. The SSD tier is not supported
when distributed (RuntimeConfig refuses `--ssd-cache`).

`StepChannel` runs on the engine thread (of rank 0, or a follower's main thread).
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

import attrs

from mlxd.engine.ops import RowStart, StepOps
from mlxd.kv.shard_mirror import PrefixRef, ShardRef
from mlxd.runtime.kernel.messages import GenerationRequest, SamplingParams
from mlxd.structured.spec import Constraint

# Drops sent with one step at most; the rest go with the next ones.
MAX_DROPS_PER_STEP = 512


def world_rank() -> int:
    """This process's rank as `mlx.launch` set it (0 when not launched by it)."""
    return int(os.environ.get("MLX_RANK", "0"))


def pin_seed(request: GenerationRequest) -> GenerationRequest:
    """A sampling request with a seed, so every rank draws the same tokens."""
    s = request.sampling
    if s.temperature <= 0 or s.seed is not None:
        return request
    seed = int.from_bytes(os.urandom(4), "little")
    return attrs.evolve(request, sampling=attrs.evolve(s, seed=seed))


def encode_ops(ops: StepOps) -> bytes:
    """What the followers need of a step: rank 0's own prefixes, restores and resumes stay behind."""
    doc = {
        "starts": [attrs.asdict(s.request) for s in ops.starts],
        "cuts": [list(s.checkpoint_at) for s in ops.starts],  # every rank cuts its prefill alike
        "prefixes": [None if p is None else attrs.asdict(p) for p in ops.prefixes],
        "cancels": list(ops.cancels),
        "stops": list(ops.stops),
        "drops": [[r.key, r.seq] for r in ops.drops],
        "reset": ops.reset,
        "discard": ops.discard,
        "shutdown": ops.shutdown,
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_ops(data: bytes) -> StepOps:
    doc = json.loads(data)
    return StepOps(
        starts=tuple(RowStart(request=_request(r), checkpoint_at=tuple(int(c) for c in cuts))
                     for r, cuts in zip(doc["starts"], doc.get("cuts") or [[] for _ in doc["starts"]], strict=True)),
        prefixes=tuple(None if p is None else PrefixRef(str(p["key"]), int(p["usable"]), int(p["total"]))
                       for p in doc["prefixes"]),
        cancels=tuple(str(u) for u in doc["cancels"]),
        stops=tuple(str(u) for u in doc["stops"]),
        drops=tuple(ShardRef(str(k), int(seq)) for k, seq in doc["drops"]),
        reset=bool(doc["reset"]),
        discard=bool(doc["discard"]),
        shutdown=bool(doc["shutdown"]),
    )


def _request(doc: dict[str, Any]) -> GenerationRequest:
    s = dict(doc["sampling"])
    s["stop_token_ids"] = tuple(s["stop_token_ids"])
    s["logit_bias"] = tuple((int(t), float(b)) for t, b in s["logit_bias"])
    c = s.get("constraint")
    s["constraint"] = None if c is None else Constraint(c["kind"], c["source"])
    return GenerationRequest(
        request_id=doc["request_id"],
        prompt=tuple(doc["prompt"]),
        sampling=SamplingParams(**s),
        namespace=doc["namespace"],
        session=doc["session"],
        checkpoint_at=tuple(int(c) for c in doc.get("checkpoint_at") or ()),
    )


class StepChannel:
    """Rank 0 -> every follower, one `StepOps` per step (engine thread only).

    Under `mlx.launch --backend ring` the ops travel over plain TCP
    connections from each follower to rank 0 (rank 0's host from the ring's
    hostfile, its port agreed through one `all_sum` at load): a follower
    waiting for the next step sleeps in the kernel. MLX's ring collectives
    poll while they wait (docs/benchmarks.md), which an idle server would pay
    all the time.

    Without a ring hostfile (other backends) the ops go through `all_sum`
    itself: followers add zeros. That runs on the engine's stream, the one
    the model's collectives run on, because `BatchGenerator` leaves the next
    decode step's forward pass in flight (`mx.async_eval`) and collectives on
    two streams could pair up across ranks in different orders.
    """

    def __init__(self, group: Any, stream: Any) -> None:
        self.group = group
        self.stream = stream
        self._peers: list[socket.socket] = []  # rank 0: one per follower
        self._leader: socket.socket | None = None  # a follower: its connection to rank 0

    @property
    def mode(self) -> str:
        """How steps travel: "tcp" (the side channel), "all_sum", or "none" (a world of one)."""
        if self._peers or self._leader is not None:
            return "tcp"
        return "all_sum" if self.size > 1 else "none"

    @property
    def rank(self) -> int:
        return int(self.group.rank())

    @property
    def size(self) -> int:
        return int(self.group.size())

    def connect(self, timeout: float = 120.0) -> None:
        """Open the side channel, on every rank at the same point of the load (a collective)."""
        import mlx.core as mx

        host = _leader_host()
        if self.size == 1:
            return
        if self.rank == 0:
            server = socket.create_server((host, 0)) if host is not None else None
            port = server.getsockname()[1] if server is not None else 0
            self._sum(mx.array([port], dtype=mx.int32))
            if server is None:
                return
            with server:
                server.settimeout(timeout)
                peers: dict[int, socket.socket] = {}
                while len(peers) < self.size - 1:
                    conn, _ = server.accept()
                    conn.settimeout(timeout)
                    rank = int.from_bytes(_recv_exactly(conn, 4), "big")
                    if not 0 < rank < self.size or rank in peers:
                        conn.close()
                        continue
                    conn.settimeout(None)
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    peers[rank] = conn
            self._peers = [peers[r] for r in sorted(peers)]
        else:
            port = int(self._sum(mx.zeros((1,), dtype=mx.int32)).item())
            if port == 0:
                return
            assert host is not None
            conn = socket.create_connection((host, port), timeout=timeout)
            conn.sendall(self.rank.to_bytes(4, "big"))
            conn.settimeout(None)
            self._leader = conn

    def close(self) -> None:
        for conn in [*self._peers, *([self._leader] if self._leader else [])]:
            conn.close()
        self._peers, self._leader = [], None

    def _sum(self, x: Any) -> Any:
        import mlx.core as mx

        out = mx.distributed.all_sum(x, group=self.group, stream=self.stream)
        mx.eval(out)
        return out

    def send(self, ops: StepOps) -> None:
        """Rank 0: broadcast `ops` (the followers are waiting in `receive`)."""
        import mlx.core as mx
        import numpy as np

        data = encode_ops(ops)
        if self._peers:
            frame = len(data).to_bytes(4, "big") + data
            for conn in self._peers:
                conn.sendall(frame)
            return
        self._sum(mx.array([len(data)], dtype=mx.int32))
        self._sum(mx.array(np.frombuffer(data, dtype=np.uint8)))

    def gather_missing(self) -> int:
        """Rank 0, after sending a step that lends prefixes: how many the followers lack (0: go on)."""
        import mlx.core as mx

        if self._peers:
            return sum(int.from_bytes(_recv_exactly(conn, 4, "a follower rank"), "big") for conn in self._peers)
        return int(self._sum(mx.zeros((1,), dtype=mx.int32)).item())

    def confirm(self, missing: int) -> None:
        """A follower, before a step that lends prefixes: how many of them it lacks."""
        import mlx.core as mx

        if self._leader is not None:
            self._leader.sendall(missing.to_bytes(4, "big"))
            return
        self._sum(mx.array([missing], dtype=mx.int32))

    def receive(self) -> StepOps:
        """A follower: wait for rank 0's next `StepOps`."""
        import mlx.core as mx
        import numpy as np

        if self._leader is not None:
            n = int.from_bytes(_recv_exactly(self._leader, 4), "big")
            return decode_ops(_recv_exactly(self._leader, n))
        n = int(self._sum(mx.zeros((1,), dtype=mx.int32)).item())
        data = np.array(self._sum(mx.zeros((n,), dtype=mx.uint8)), copy=False).tobytes()
        return decode_ops(data)


def _leader_host() -> str | None:
    """Rank 0's host from the ring backend's hostfile (`MLX_HOSTFILE`), or None without one."""
    path = os.environ.get("MLX_HOSTFILE")
    if not path:
        return None
    try:
        with open(path) as f:
            hosts = json.load(f)
        return str(hosts[0][0]).rsplit(":", 1)[0]
    except (OSError, ValueError, IndexError, KeyError, TypeError):
        return None


def _recv_exactly(conn: socket.socket, n: int, who: str = "rank 0") -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"{who} closed the step channel")
        buf += chunk
    return bytes(buf)

"""Serving one model sharded over several processes with MLX's distributed runtime.

`mlx.launch` starts one `mlxd serve --distributed` per rank. Each loads the
model and shards it with mlx-lm's own tensor parallelism (`model.shard(group)`:
attention heads and MLP columns split across ranks, partial results summed by
`all_sum` inside the forward pass). Rank 0 is the server: HTTP, scheduler,
engine. The other ranks are followers: they run no HTTP and no cache, only
the engine's step function, fed by rank 0.

Every forward pass is a collective, so all ranks must run the same sequence of
`BatchGenerator` operations (insert the same prompts with the same samplers,
remove the same rows, `next()`), in the same order. Before each step rank 0
broadcasts the step's inputs (`StepOps`: the requests that join, the rows
cancelled or stopped) as bytes through an `all_sum` (followers add zeros), and
every follower replays them through the same `EngineActor._step`. Sampling is
the same on every rank: the logits after the last `all_sum` are equal, greedy
rows take their argmax, and a sampling row's seed is fixed by rank 0 before
the broadcast (`pin_seed`).

The prompt cache is off when the world size is above one (RuntimeConfig
refuses it): a lent prefix on rank 0 would have to be the same tokens' KV shard
on every follower, which this first version does not keep.

Pure encoding here; the collectives run on the engine thread (`StepChannel`).
"""

from __future__ import annotations

import json
import os
from typing import Any

import attrs

from mlxd.runtime.messages import GenerationRequest, SamplingParams


@attrs.frozen
class StepOps:
    """What rank 0's engine does in one step, for the followers to do the same."""

    starts: tuple[GenerationRequest, ...] = ()
    cancels: tuple[int, ...] = ()
    stops: tuple[int, ...] = ()
    reset: bool = False  # a failed step: drop the generator and start a fresh one
    shutdown: bool = False  # rank 0 is stopping: followers exit


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
    return json.dumps(attrs.asdict(ops), separators=(",", ":")).encode()


def decode_ops(data: bytes) -> StepOps:
    doc = json.loads(data)
    return StepOps(
        starts=tuple(_request(r) for r in doc["starts"]),
        cancels=tuple(int(u) for u in doc["cancels"]),
        stops=tuple(int(u) for u in doc["stops"]),
        reset=bool(doc["reset"]),
        shutdown=bool(doc["shutdown"]),
    )


def _request(doc: dict[str, Any]) -> GenerationRequest:
    s = dict(doc["sampling"])
    s["stop_token_ids"] = tuple(s["stop_token_ids"])
    s["logit_bias"] = tuple((int(t), float(b)) for t, b in s["logit_bias"])
    return GenerationRequest(
        request_id=doc["request_id"],
        prompt=tuple(doc["prompt"]),
        sampling=SamplingParams(**s),
        namespace=doc["namespace"],
        session=doc["session"],
    )


class StepChannel:
    """Rank 0 -> every follower, one `StepOps` per step, over the MLX group (engine thread only).

    The broadcast runs on the engine's stream, the one the model's own
    collectives run on: `BatchGenerator` leaves the next decode step's forward
    pass in flight (`mx.async_eval`), and collectives on two streams could
    pair up across ranks in different orders.
    """

    def __init__(self, group: Any, stream: Any) -> None:
        self.group = group
        self.stream = stream

    @property
    def rank(self) -> int:
        return int(self.group.rank())

    @property
    def size(self) -> int:
        return int(self.group.size())

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
        self._sum(mx.array([len(data)], dtype=mx.int32))
        self._sum(mx.array(np.frombuffer(data, dtype=np.uint8)))

    def receive(self) -> StepOps:
        """A follower: wait for rank 0's next `StepOps`."""
        import mlx.core as mx
        import numpy as np

        n = int(self._sum(mx.zeros((1,), dtype=mx.int32)).item())
        data = np.array(self._sum(mx.zeros((n,), dtype=mx.uint8)), copy=False).tobytes()
        return decode_ops(data)

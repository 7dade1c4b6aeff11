"""What prefill, decode and restore cost on one machine, and restore-or-recompute.

Attention makes prefill cost grow with context: each new token attends to the
cached prefix plus the new tokens before it. So prefill of `n` new tokens on a
`ctx`-token prefix costs about

    fixed + a * n + b * (n * ctx + n * n / 2)

where `a` is the per-token cost of the matmuls and `b` the per-pair cost of
attention. Decode is the same model one token at a time. Restoring a prefix
from SSD costs `restore_fixed + bytes / restore_bytes_per_s`.

The simulator (`mlxd simulate`) charges these costs in virtual time, and
`mlxd.kv.restore_decision.RestoreAdvisor` starts from them to decide whether a
cold entry is worth reading back (serving and simulation alike). `mlxd simulate --calibrate` measures a model on this
machine's real engine (see `mlxd.sim.calibrate`). This module is pure.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs

BLOCK_TOKENS = 512  # the Mooncake block size, also used to express capacities


@attrs.frozen(kw_only=True)
class CostModel:
    """Seconds of engine time per operation, and KV bytes per token."""

    model: str = "default"
    prefill_fixed: float  # seconds per prefill call
    prefill_per_token: float  # `a`: seconds per new token
    prefill_per_pair: float  # `b`: seconds per (new token, attended token) pair
    decode_per_token: float  # seconds per generated token at empty context
    decode_per_pair: float  # seconds per generated token per context token
    restore_fixed: float  # seconds per SSD restore (open, header, setup)
    restore_bytes_per_s: float  # SSD restore bandwidth into RAM
    kv_bytes_per_token: int  # KV bytes one token of context occupies
    # Host tier (--host-cache-gb) back to the device; 0 = free (unified memory: nothing moves).
    host_bytes_per_s: float = 0.0
    # A restore of bytes already in the page cache (a file written or read recently); 0 = not measured
    # (they cost as the rest: restore_bytes_per_s).
    page_cache_bytes_per_s: float = 0.0
    # Measured / modelled time of a recording's requests (`mlxd.sim.ttft_fit`): a replay scales each
    # request's restore and prefill by one of their quantiles (the recorded machine's spread); () = none.
    service_ratios: tuple[float, ...] = attrs.field(default=(), converter=lambda xs: tuple(float(x) for x in xs))
    # The same per tier of the replay ("miss", "ram", "ssd", "host"): a tier with its own spread takes it
    # instead (its median corrects what the shared fit gets wrong for that tier); others take the pooled one.
    tier_ratios: dict[str, tuple[float, ...]] = attrs.field(
        factory=dict, converter=lambda d: {str(k): tuple(float(x) for x in v) for k, v in d.items()}, hash=False
    )
    # Per tier, a recording's median time from submission to a slot for requests that arrived with the server
    # otherwise idle (`mlxd.sim.ttft_fit`): no slot wait, the server's own work before the request starts (on
    # the H200 an SSD hit's, ~30-50 ms: its prefetch read starts at submission). A replay adds it to the tier's
    # TTFT; {} = none.
    admission_s: dict[str, float] = attrs.field(
        factory=dict, converter=lambda d: {str(k): float(v) for k, v in d.items()}, hash=False
    )
    # Per tier, how many of a recording's requests the fit left out of the spread as far-out outliers
    # (`mlxd.sim.ttft_fit`: a one-off such as a shape's first compile, not the tier's tail); {} = none.
    outliers: dict[str, int] = attrs.field(
        factory=dict, converter=lambda d: {str(k): int(v) for k, v in d.items()}, hash=False
    )

    def prefill_seconds(self, new_tokens: int, context: int = 0) -> float:
        """Prefill `new_tokens` on top of a `context`-token cached prefix."""
        if new_tokens <= 0:
            return 0.0
        n = float(new_tokens)
        pairs = n * context + n * n / 2
        return self.prefill_fixed + self.prefill_per_token * n + self.prefill_per_pair * pairs

    def decode_seconds(self, tokens: int, context: int) -> float:
        """Generate `tokens` tokens one at a time after a `context`-token prompt."""
        if tokens <= 0:
            return 0.0
        n = float(tokens)
        pairs = n * context + n * n / 2
        return self.decode_per_token * n + self.decode_per_pair * pairs

    def restore_seconds(self, nbytes: int) -> float:
        """Read `nbytes` of KV state back from SSD into RAM."""
        return self.restore_fixed + nbytes / self.restore_bytes_per_s

    def host_seconds(self, nbytes: int) -> float:
        """Bring `nbytes` of KV back from the host tier to the device."""
        return nbytes / self.host_bytes_per_s if self.host_bytes_per_s > 0 else 0.0

    def kv_bytes(self, tokens: int) -> int:
        """KV bytes of a `tokens`-token prefix."""
        return tokens * self.kv_bytes_per_token

    def to_json(self) -> dict:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> CostModel:
        known = {f.name for f in attrs.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        return cls.from_json(json.loads(Path(path).read_text()))


# Measured with `mlxd simulate --calibrate --calibrate-tokens 2048` on the
# `default` preset (fp32, 8 layers, 2 KV heads x 64 dims) on this repo's 2-core
# Linux x86_64 box with OpenBLAS, shared with other jobs (so noisy); saved as
# simulations/cost_models/cpu-default.json. Restore bandwidth is a warm
# page-cache read. Recalibrate on your machine; these only set the scale.
DEFAULT = CostModel(
    model="default",
    prefill_fixed=0.0,
    prefill_per_token=1.64e-3,
    prefill_per_pair=1.34e-6,
    decode_per_token=1.30e-2,
    decode_per_pair=7.85e-6,
    restore_fixed=0.97e-3,
    restore_bytes_per_s=7.8e9,
    kv_bytes_per_token=8192,
)

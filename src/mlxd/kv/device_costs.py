"""What the startup probe measured on this device, and the cost model fitted to it.

The restore advisor (`kv.restore_decision`) needs to know, before the first
request, how long this device takes to prefill and to restore: a CPU and an
H200 differ by two orders of magnitude in prefill speed, so a model carried
over from another machine makes the first choices wrong (docs/benchmarks.md,
H200: restore or recompute). The engine
measures a few prefills from an empty context (seconds, at growing lengths), a
few decode steps, and a cold restore of a real snapshot file; this module fits
`fixed + a*n + b*n*n/2` to the prefills and `fixed + bytes/bandwidth` to the
restores. Pure: no trio, no MLX.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import attrs

from mlxd.kv.cost_model import DEFAULT, CostModel

# A probe's fields about the process that holds it, not the device: never saved for the next server.
_THIS_PROCESS = frozenset({"reused", "warmup_tokens", "warmup_s"})


@attrs.frozen(kw_only=True)
class DeviceProbe:
    """One startup probe's measurements on the serving device."""

    device: str
    prefill: tuple[tuple[int, float], ...]  # (prompt tokens from empty context, seconds)
    decode_s_per_token: float
    restore: tuple[tuple[int, float], ...] = ()  # (file bytes, seconds to read cold + adopt)
    # (file bytes, seconds to read + adopt the same file again, from the page cache: as serving meets a
    # file written or read recently, e.g. a restarted server's newest files)
    restore_warm: tuple[tuple[int, float], ...] = ()
    restore_landing: str = ""  # where the timed restores were read to: "mlx" or "host" (serving's landing)
    restore_layout: str = ""  # "whole" or "blocks" (serving's layout)
    restores_into_mlx: int = 0  # timed restores that were read straight into MLX arrays
    # Each cold restore's (bytes, seconds of the landing's allocation, of the read, of the adoption).
    restore_parts: tuple[tuple[int, float, float, float], ...] = ()
    host: tuple[tuple[int, float], ...] = ()  # (KV bytes, seconds to promote from the host tier)
    kv_bytes_per_token: int
    prefill_step_size: int  # the chunk size prefill runs with (chosen by the probe if tuned)
    step_trials: tuple[tuple[int, float], ...] = ()  # (chunk size, seconds for the same prefill)
    seconds: float = 0.0  # wall time of the whole probe
    reused: bool = False  # the last server's probe on this device and setup, not measured again (kv/probe_file.py)
    # This process ran the probe's longest prefill once more, untimed, before serving (`--device-warmup`):
    # its tokens and seconds (0: no warm-up ran).
    warmup_tokens: int = 0
    warmup_s: float = 0.0

    def saved(self) -> dict[str, Any]:
        """Every measurement as it was (no rounding), for `from_saved` in the next server."""
        return {k: v for k, v in attrs.asdict(self).items() if k not in _THIS_PROCESS}

    @classmethod
    def from_saved(cls, data: dict[str, Any]) -> DeviceProbe:
        """A probe `saved()` wrote; ValueError (or TypeError/KeyError) when it is not one."""
        pairs = ("prefill", "restore", "restore_warm", "host", "step_trials")
        fields = {k: v for k, v in data.items() if k in attrs.fields_dict(cls) and k not in _THIS_PROCESS}
        for k in pairs:
            fields[k] = tuple((int(a), float(b)) for a, b in fields.get(k, ()))
        fields["restore_parts"] = tuple((int(b), float(x), float(y), float(z))
                                        for b, x, y, z in fields.get("restore_parts", ()))
        for k, kind in (("decode_s_per_token", float), ("seconds", float), ("kv_bytes_per_token", int),
                        ("prefill_step_size", int), ("restores_into_mlx", int)):
            if k in fields:  # a field of another type passed here, then failed serving (a chunk size of "x")
                fields[k] = kind(fields[k])
        for k in ("device", "restore_landing", "restore_layout"):
            if not isinstance(fields.get(k, ""), str):
                raise TypeError(f"a saved probe's {k} is not a string")
        probe = cls(**fields)
        if not probe.prefill or probe.kv_bytes_per_token <= 0 or probe.prefill_step_size <= 0:
            raise ValueError("a saved probe without prefill points")
        if not math.isfinite(probe.decode_s_per_token) or probe.decode_s_per_token < 0:
            raise ValueError("a saved probe's decode rate is not a time")
        probe.cost_model()  # fits, or raises ValueError
        return attrs.evolve(probe, reused=True)

    def cost_model(self) -> CostModel:
        fixed, per_token, per_pair = fit_prefill(self.prefill)
        if self.restore:
            restore_fixed, per_byte = fit_linear(self.restore)
            if per_byte <= 0:  # noise left no slope (the larger read no slower): the largest point's own rate
                nbytes, seconds = max(self.restore)
                restore_fixed, per_byte = 0.0, seconds / nbytes if nbytes > 0 else 0.0
            restore_bw = 1.0 / per_byte if per_byte > 0 else DEFAULT.restore_bytes_per_s
        else:
            restore_fixed, restore_bw = DEFAULT.restore_fixed, DEFAULT.restore_bytes_per_s
        warm_bw = 0.0  # not measured: page-cache bytes cost as the rest
        if self.restore_warm:  # per byte, as the cold restores (their fixed cost is restore_fixed)
            _, warm_per_byte = fit_linear(self.restore_warm)
            if warm_per_byte <= 0:  # noise left no slope (small points): the largest point's own rate
                nbytes, seconds = max(self.restore_warm)
                warm_per_byte = seconds / nbytes if nbytes > 0 else 0.0
            warm_bw = 1.0 / warm_per_byte if warm_per_byte > 0 else 0.0
        host_bw = 0.0  # no host tier timed (or unified memory): promotions are free
        if self.host and sum(s for _, s in self.host) > 0:
            host_bw = sum(b for b, _ in self.host) / sum(s for _, s in self.host)
        return CostModel(
            model=f"probe:{self.device}",
            prefill_fixed=fixed,
            prefill_per_token=per_token,
            prefill_per_pair=per_pair,
            decode_per_token=self.decode_s_per_token,
            decode_per_pair=0.0,  # not probed: decode does not enter restore decisions
            restore_fixed=restore_fixed,
            restore_bytes_per_s=restore_bw,
            kv_bytes_per_token=self.kv_bytes_per_token,
            host_bytes_per_s=host_bw,
            page_cache_bytes_per_s=warm_bw,
        )

    def as_dict(self) -> dict[str, Any]:
        model = self.cost_model()
        return {
            "device": self.device,
            "seconds": round(self.seconds, 3),
            "reused": self.reused,
            "warmup": {"tokens": self.warmup_tokens, "seconds": round(self.warmup_s, 3)} if self.warmup_tokens else None,
            "prefill": [{"tokens": n, "seconds": round(s, 5)} for n, s in self.prefill],
            "prefill_tokens_per_s": round(self.prefill[-1][0] / self.prefill[-1][1], 1) if self.prefill else None,
            "decode_tokens_per_s": round(1.0 / self.decode_s_per_token, 2) if self.decode_s_per_token > 0 else None,
            "restore": [{"bytes": b, "seconds": round(s, 5)} for b, s in self.restore],
            "restore_bytes_per_s": round(model.restore_bytes_per_s) if self.restore else None,
            "restore_warm": [{"bytes": b, "seconds": round(s, 5)} for b, s in self.restore_warm],
            "page_cache_bytes_per_s": round(model.page_cache_bytes_per_s) if self.restore_warm else None,
            "restore_landing": self.restore_landing or None,
            "restore_layout": self.restore_layout or None,
            "restores_into_mlx": self.restores_into_mlx,
            "restore_parts": [{"bytes": b, "landing_s": round(a, 5), "read_s": round(r, 5), "adopt_s": round(d, 5)}
                              for b, a, r, d in self.restore_parts],
            "host": [{"bytes": b, "seconds": round(s, 5)} for b, s in self.host],
            "host_bytes_per_s": round(model.host_bytes_per_s) if self.host else None,
            "prefill_step_size": self.prefill_step_size,
            "step_trials": [{"step": n, "seconds": round(s, 5)} for n, s in self.step_trials],
            "cost_model": model.to_json(),
        }


def fit_prefill(points: Sequence[tuple[int, float]]) -> tuple[float, float, float]:
    """(fixed, per_token, per_pair) >= 0 for `t = fixed + a*n + b*n*n/2`, least relative error.

    Each point is weighted by 1/t, so a 100 ms probe counts as much as a 2 s one;
    coefficients that would come out negative are dropped (the best fit over the
    non-negative subsets wins).
    """
    rows = [(1.0, float(n), float(n) * n / 2.0, float(t)) for n, t in points if n > 0 and t > 0]
    if not rows:
        raise ValueError("no prefill measurements to fit")
    best = _best_nonnegative(rows, 3)
    return best[0], best[1], best[2]


def fit_linear(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(fixed, per_unit) >= 0 for `t = fixed + per_unit * x`, least relative error."""
    rows = [(1.0, float(x), float(t)) for x, t in points if x > 0 and t > 0]
    if not rows:
        raise ValueError("no measurements to fit")
    best = _best_nonnegative(rows, 2)
    return best[0], best[1]


def _best_nonnegative(rows: Sequence[tuple[float, ...]], k: int) -> list[float]:
    import numpy as np

    a = np.array([r[:k] for r in rows], dtype=np.float64)
    t = np.array([r[k] for r in rows], dtype=np.float64)
    w = 1.0 / t  # relative error
    best: tuple[float, list[float]] | None = None
    for size in range(k, 0, -1):
        for cols in itertools.combinations(range(k), size):
            if len(rows) < size:
                continue
            sub = a[:, cols] * w[:, None]
            coef, *_ = np.linalg.lstsq(sub, t * w, rcond=None)
            if (coef < 0).any():
                continue
            full = [0.0] * k
            for c, v in zip(cols, coef, strict=True):
                full[c] = float(v)
            err = float(np.sum(((a @ np.array(full)) - t) ** 2 * w**2))
            if best is None or err < best[0] - 1e-12:
                best = (err, full)
    if best is None:  # one point and every single column negative: impossible for t > 0
        raise ValueError("no non-negative fit")
    return best[1]

"""Restore or recompute: decide per request with costs measured on the running engine.

Restoring a cold prefix is not always cheaper than prefill: on a fast
accelerator a long prefill can beat reading and adopting gigabytes of KV; on a
CPU the restore wins by orders of magnitude. The advisor starts from a
`CostModel` and calibrates it online from the engine's own timings: an
exponentially weighted scale on prefill cost, and the observed restore
bandwidth. Pure: no trio, no MLX.
"""

from __future__ import annotations

import attrs

from mlxd.kv.cost_model import DEFAULT, CostModel

_WEIGHT = 0.3  # weight of a new observation in the moving averages


@attrs.define
class RestoreAdvisor:
    base: CostModel = DEFAULT
    prefill_scale: float = 1.0
    restore_bytes_per_s: float = attrs.field(default=None)
    prefill_samples: int = 0
    restore_samples: int = 0
    always: bool = False  # restore whatever the costs say (RuntimeConfig.restore_choice "always")
    restores_chosen: int = 0
    recomputes_chosen: int = 0

    def __attrs_post_init__(self) -> None:
        if self.restore_bytes_per_s is None:
            self.restore_bytes_per_s = self.base.restore_bytes_per_s

    def observe_prefill(self, *, new_tokens: int, context: int, seconds: float) -> None:
        """A prefill chunk of `new_tokens` on a `context`-token prefix took `seconds`."""
        predicted = self.base.prefill_seconds(new_tokens, context)
        if new_tokens < 16 or predicted <= 0 or seconds <= 0:
            return  # too small to say anything about throughput
        ratio = seconds / predicted
        self.prefill_scale = ratio if self.prefill_samples == 0 else _ewma(self.prefill_scale, ratio)
        self.prefill_samples += 1

    def observe_restore(self, *, nbytes: int, seconds: float) -> None:
        """Reading and adopting `nbytes` of KV took `seconds` end to end."""
        if nbytes < 1 << 16 or seconds <= 0:
            return
        rate = nbytes / seconds
        first = self.restore_samples == 0
        self.restore_bytes_per_s = rate if first else _ewma(self.restore_bytes_per_s, rate)
        self.restore_samples += 1

    def prefill_seconds(self, new_tokens: int, context: int) -> float:
        return self.prefill_scale * self.base.prefill_seconds(new_tokens, context)

    def restore_seconds(self, nbytes: int) -> float:
        return self.base.restore_fixed + nbytes / self.restore_bytes_per_s

    def should_restore(self, *, restore_bytes: int, cold_tokens: int, warm_tokens: int, prompt_tokens: int) -> bool:
        """Restore `cold_tokens` from SSD, or prefill on top of the `warm_tokens` RAM prefix?"""
        with_restore = self.restore_seconds(restore_bytes) + self.prefill_seconds(
            prompt_tokens - cold_tokens, cold_tokens
        )
        recompute = self.prefill_seconds(prompt_tokens - warm_tokens, warm_tokens)
        choice = self.always or with_restore < recompute
        if choice:
            self.restores_chosen += 1
        else:
            self.recomputes_chosen += 1
        return choice

    def stats(self) -> dict[str, float]:
        return {
            "restores_chosen": self.restores_chosen,
            "recomputes_chosen": self.recomputes_chosen,
            "prefill_scale": round(self.prefill_scale, 4),
            "prefill_samples": self.prefill_samples,
            "restore_bytes_per_s": round(self.restore_bytes_per_s),
            "restore_samples": self.restore_samples,
        }


def _ewma(old: float, new: float) -> float:
    return (1 - _WEIGHT) * old + _WEIGHT * new

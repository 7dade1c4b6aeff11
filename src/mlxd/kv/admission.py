"""Admission by KV bytes: a request starts only when the memory it can grow to fits the memory budget.

A request can grow to `prompt + max_tokens` tokens of KV, `kv_bytes_per_token`
each under the KV scheme (the engine's `EngineInfo.kv_bytes_per_token`, plus
the draft model's own KV with `--draft-model`), allocated in steps of
`kv_step` tokens (mlx-lm's caches grow by 256). While it prefills it also
holds the chunk's working memory (activations, attention scores): modeled as
`prefill_per_token * S + prefill_per_token_context * S * L` for its largest
chunk (`S = min(prompt, prefill_step)` new tokens attending to `L = prompt`),
from two prefills measured at load (engine/memory_costs.py); that part is
released at its first token (`prefilled`).

The memory budget (`--memory-budget`) holds the fixed memory (`fixed_bytes`:
serving counts this runtime's own memory measured at load on the engine
thread, as a delta of MLX's active memory, so another runtime in the process
is not counted; never less than the weights' files), the rows being
generated, and the RAM tier (`RamRoom`, which the cache owner reports by
message): the bytes the tiers cannot free now (entries still waiting for their
SSD write, pinned ones: `unfreeable`) and the bytes they can (durable entries
demoted, droppable ones evicted: `freeable`).

So a request is

- admitted when `fixed + reserved rows + RAM tier + its need <= budget`;
- admitted once the tiers free `free_ram_bytes` (`Admit.free_ram_bytes`, the
  scheduler asks the cache owner first) when it fits only beside the
  unfreeable part, `fixed + reserved rows + unfreeable + its need <= budget`,
  or when no other row is running (it fits alone: `fixed + its need <= budget`);
- left waiting at the head of the queue otherwise, until rows finish;
- refused at once when it can never fit: `fixed + its need > budget` (HTTP
  400, with the numbers).

Pure and synchronous (no trio): the scheduler drives it, and `mlxd simulate
--kv-admission-gb` applies it to a replay (`sim/replay.py`; the budget there
is the room for rows' KV, no weights modeled; a recording of a server that
ran `--kv-admission` replays with that room).
"""

from __future__ import annotations

from pathlib import Path

import attrs

MB = 1024 * 1024


@attrs.frozen
class RamRoom:
    """What the RAM tier holds against the memory budget (the cache owner's reply to `ReleaseRam`)."""

    unfreeable_bytes: int = 0  # pinned, or waiting for its SSD write: stays whatever rows need
    freeable_bytes: int = 0  # durable (demoted) or droppable (evicted) entries: freed when rows need the room


@attrs.frozen
class Admit:
    """Start now, once the tiers freed `free_ram_bytes` of the RAM tier (0: it fits as it is)."""

    nbytes: int
    free_ram_bytes: int = 0


@attrs.frozen
class Wait:
    """Not now: `free_bytes` are left of the budget and the request needs `nbytes`."""

    nbytes: int
    free_bytes: int


@attrs.frozen
class Refuse:
    """Never: the request's KV alone does not fit the budget beside the fixed memory."""

    nbytes: int
    message: str


Decision = Admit | Wait | Refuse


@attrs.define
class KvAdmission:
    """Reservations of the rows admitted, against the memory budget (0 = admit everything)."""

    budget_bytes: int
    kv_bytes_per_token: int
    fixed_bytes: int = 0  # memory no request frees (serving: this runtime's own, measured at load)
    kv_step: int = 1  # KV is allocated in steps of this many tokens (mlx-lm: 256)
    prefill_step: int = 0  # tokens per prefill chunk (0: a whole prompt at once)
    prefill_per_token: float = 0.0  # a prefill chunk's working memory, bytes per new token ...
    prefill_per_token_context: float = 0.0  # ... and per new token per token attended to
    _reserved: dict[str, int] = attrs.field(factory=dict)  # request -> its KV
    _prefilling: dict[str, int] = attrs.field(factory=dict)  # request -> its prefill working memory
    admitted: int = 0
    waited: int = 0  # admissions that had to wait for room
    refused: int = 0
    peak_reserved_bytes: int = 0
    peak_running: int = 0  # the most requests holding reservations at once
    peak_prefilling: int = 0  # the most requests holding prefill working memory at once

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0 and self.kv_bytes_per_token > 0

    @property
    def reserved_bytes(self) -> int:
        return sum(self._reserved.values()) + sum(self._prefilling.values())

    @property
    def running(self) -> int:
        return len(self._reserved)

    def kv_bytes(self, prompt_tokens: int, max_tokens: int) -> int:
        """The KV a request can grow to: every prompt token and every token it may generate."""
        step = max(1, self.kv_step)
        return -(-(prompt_tokens + max_tokens) // step) * step * self.kv_bytes_per_token

    def prefill_bytes(self, prompt_tokens: int) -> int:
        """The working memory of the request's largest prefill chunk (its last: the most context)."""
        chunk = min(prompt_tokens, self.prefill_step) if self.prefill_step > 0 else prompt_tokens
        return int(self.prefill_per_token * chunk + self.prefill_per_token_context * chunk * prompt_tokens)

    def need_bytes(self, prompt_tokens: int, max_tokens: int) -> int:
        return self.kv_bytes(prompt_tokens, max_tokens) + self.prefill_bytes(prompt_tokens)

    def never_fits(self, prompt_tokens: int, max_tokens: int) -> str | None:
        """Why a request can never be admitted (None: it can), naming the numbers."""
        if not self.enabled:
            return None
        kv, work = self.kv_bytes(prompt_tokens, max_tokens), self.prefill_bytes(prompt_tokens)
        room = self.budget_bytes - self.fixed_bytes
        if kv + work <= room:
            return None
        working = f" and {work / MB:.1f} MiB of prefill working memory" if work else ""
        return (
            f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) need {kv / MB:.1f} MiB of KV "
            f"({self.kv_bytes_per_token} bytes per token){working}, more than the {max(0, room) / MB:.1f} MiB the "
            f"memory budget ({self.budget_bytes / MB:.1f} MiB) leaves beside the model ({self.fixed_bytes / MB:.1f} "
            f"MiB): lower max_tokens or shorten the prompt"
        )

    def decide(self, prompt_tokens: int, max_tokens: int, *, ram: RamRoom | None = None) -> Decision:
        """Admit, wait or refuse a request now (nothing is reserved: see `admit`). `ram`: what the RAM
        tier holds now; a request that fits only once its freeable part goes is admitted with
        `free_ram_bytes` to free first (the freeable bytes in the way, never more)."""
        if not self.enabled:
            return Admit(0)
        need = self.need_bytes(prompt_tokens, max_tokens)
        why = self.never_fits(prompt_tokens, max_tokens)
        if why is not None:
            return Refuse(need, why)
        ram = ram or RamRoom()
        freeable = max(0, ram.freeable_bytes)
        free = self.budget_bytes - self.fixed_bytes - self.reserved_bytes - max(0, ram.unfreeable_bytes)
        if need <= free or not self._reserved:
            return Admit(need, free_ram_bytes=min(freeable, max(0, need - (free - freeable))))
        return Wait(need, free)

    def admit(self, request_id: str, nbytes: int, *, waited: bool = False, prefill_bytes: int = 0) -> None:
        """Reserve `nbytes` for the request, `prefill_bytes` of them until its first token (`prefilled`)."""
        work = min(max(0, prefill_bytes), nbytes)
        self._reserved[request_id] = nbytes - work
        if work:
            self._prefilling[request_id] = work
        self.admitted += 1
        self.waited += int(waited)
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        self.peak_running = max(self.peak_running, self.running)
        self.peak_prefilling = max(self.peak_prefilling, len(self._prefilling))

    def prefilled(self, request_id: str) -> bool:
        """The request has its first token: its prefill working memory is free again (True: some was)."""
        return self._prefilling.pop(request_id, None) is not None

    def release(self, request_id: str) -> None:
        self._reserved.pop(request_id, None)
        self._prefilling.pop(request_id, None)

    def rule(self) -> dict[str, float]:
        """The rule's parameters, the room beside the fixed memory included (a trace recording's server line:
        `mlxd simulate` replays the same admissions, `from_rule`)."""
        return {
            "room_bytes": self.budget_bytes - self.fixed_bytes, "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_step": self.kv_step, "prefill_step": self.prefill_step, "prefill_per_token": self.prefill_per_token,
            "prefill_per_token_context": self.prefill_per_token_context,
        }

    @classmethod
    def from_rule(cls, rule: dict[str, float]) -> KvAdmission:
        """The rule `rule()` describes, its room as the whole budget (no fixed memory modeled)."""
        return cls(
            int(rule["room_bytes"]), int(rule["kv_bytes_per_token"]), kv_step=int(rule.get("kv_step", 1)),
            prefill_step=int(rule.get("prefill_step", 0)), prefill_per_token=float(rule.get("prefill_per_token", 0)),
            prefill_per_token_context=float(rule.get("prefill_per_token_context", 0)),
        )


def weights_bytes(model_path: str | Path) -> int:
    """(I/O) The bytes of a model directory's safetensors files: the weights' share of the budget."""
    path = Path(model_path)
    try:
        files = list(path.glob("*.safetensors")) if path.is_dir() else []
        return sum(f.stat().st_size for f in files)
    except OSError:
        return 0

"""Admission by KV bytes: a request starts only when the KV it can grow to fits the memory budget.

A request can grow to `prompt + max_tokens` tokens of KV, `kv_bytes_per_token`
each under the KV scheme (the engine's `EngineInfo.kv_bytes_per_token`). The
memory budget (`--memory-budget`) holds the fixed memory (weights, buffers:
`fixed_bytes`: serving counts the weights' files; working buffers, e.g. a
long prefill's activations, are not counted, see docs/benchmarks.md), the rows being generated, and the RAM tier. The RAM tier is
what the tiers can free: under a budget they demote or evict its entries as
rows need the room (`CacheTiers.check_budget`), except entries still waiting
for their SSD write (`pinned_bytes`), which leave once written.

So a request is

- admitted when `fixed + reserved rows + pinned + its KV <= budget`, or when no
  other row is running (it fits alone: `fixed + its KV <= budget`);
- left waiting at the head of the queue otherwise, until rows finish;
- refused at once when it can never fit: `fixed + its KV > budget` (HTTP 400,
  with the numbers).

Pure and synchronous (no trio): the scheduler drives it, and `mlxd simulate
--kv-admission-gb` applies it to a replay (`sim/replay.py`; the budget there
is the room for rows' KV, no weights modeled).
"""

from __future__ import annotations

from pathlib import Path

import attrs

MB = 1024 * 1024


@attrs.frozen
class Admit:
    nbytes: int


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
    fixed_bytes: int = 0  # memory no request frees (serving: the weights' files; buffers are not counted)
    _reserved: dict[str, int] = attrs.field(factory=dict)
    admitted: int = 0
    waited: int = 0  # admissions that had to wait for room
    refused: int = 0
    peak_reserved_bytes: int = 0

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0 and self.kv_bytes_per_token > 0

    @property
    def reserved_bytes(self) -> int:
        return sum(self._reserved.values())

    @property
    def running(self) -> int:
        return len(self._reserved)

    def kv_bytes(self, prompt_tokens: int, max_tokens: int) -> int:
        """The KV a request can grow to: every prompt token and every token it may generate."""
        return (prompt_tokens + max_tokens) * self.kv_bytes_per_token

    def never_fits(self, prompt_tokens: int, max_tokens: int) -> str | None:
        """Why a request can never be admitted (None: it can), naming the numbers."""
        if not self.enabled:
            return None
        need = self.kv_bytes(prompt_tokens, max_tokens)
        room = self.budget_bytes - self.fixed_bytes
        if need <= room:
            return None
        return (
            f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) need {need / MB:.1f} MiB of KV "
            f"({self.kv_bytes_per_token} bytes per token), more than the {max(0, room) / MB:.1f} MiB the memory "
            f"budget ({self.budget_bytes / MB:.1f} MiB) leaves beside the model ({self.fixed_bytes / MB:.1f} MiB): "
            f"lower max_tokens or shorten the prompt"
        )

    def decide(self, prompt_tokens: int, max_tokens: int, *, pinned_bytes: int = 0) -> Decision:
        """Admit, wait or refuse a request now (nothing is reserved: see `admit`)."""
        need = self.kv_bytes(prompt_tokens, max_tokens) if self.enabled else 0
        if not self.enabled:
            return Admit(0)
        why = self.never_fits(prompt_tokens, max_tokens)
        if why is not None:
            return Refuse(need, why)
        free = self.budget_bytes - self.fixed_bytes - self.reserved_bytes - max(0, pinned_bytes)
        if need <= free or not self._reserved:
            return Admit(need)
        return Wait(need, free)

    def admit(self, request_id: str, nbytes: int, *, waited: bool = False) -> None:
        self._reserved[request_id] = nbytes
        self.admitted += 1
        self.waited += int(waited)
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)

    def release(self, request_id: str) -> None:
        self._reserved.pop(request_id, None)


def weights_bytes(model_path: str | Path) -> int:
    """(I/O) The bytes of a model directory's safetensors files: the weights' share of the budget."""
    path = Path(model_path)
    try:
        files = list(path.glob("*.safetensors")) if path.is_dir() else []
        return sum(f.stat().st_size for f in files)
    except OSError:
        return 0

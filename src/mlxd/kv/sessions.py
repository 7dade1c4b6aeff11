"""The session checkpoint index (seed §5.12): session id + namespace -> latest checkpoint.

A request may name an application session (HTTP `X-Session-Id`). Every
checkpoint published for it advances the session's reference to that
checkpoint's exact tokens, so the session's next request finds its state by
one prefix comparison instead of a candidate scan; a missing or incompatible
reference (an edit, a branch, a retry) falls back to ordinary prefix matching.
References also tell eviction which entries sessions still point at: those
are evicted last (a preference, not a pin).

Numerical identity stays the cache's: the index stores token keys, never
entries, so a session and an anonymous request share the same state, and an
entry that left RAM can still be found on SSD by the same key. Pure, in
memory and process-local: after a restart, sessions re-associate through
ordinary hits.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from mlxd.kv.prefix_index import TokenKey, token_key

SessionKey = tuple[str, str]  # (namespace, session id)
EntryKey = tuple[str, TokenKey]  # (namespace, exact tokens)


@attrs.frozen
class SessionStats:
    sessions: int
    referenced_entries: int
    hits: int  # follow-ups served from the session's own checkpoint (no scan)
    fallbacks: int  # follow-ups whose reference was missing or incompatible
    closed: int


@attrs.define
class SessionIndex:
    _latest: dict[SessionKey, TokenKey] = attrs.Factory(dict)
    _refs: dict[EntryKey, set[str]] = attrs.Factory(dict)
    _hits: int = 0
    _fallbacks: int = 0
    _closed: int = 0

    def __len__(self) -> int:
        return len({s for _, s in self._latest})

    def advance(self, session: str, namespace: str, tokens: Sequence[int] | np.ndarray | TokenKey) -> None:
        """The session's latest checkpoint is now the state after exactly `tokens`."""
        key = token_key(tokens)
        old = self._latest.get((namespace, session))
        if old == key:
            return
        if old is not None:
            self._unref(namespace, old, session)
        self._latest[(namespace, session)] = key
        self._refs.setdefault((namespace, key), set()).add(session)

    def latest(self, session: str, namespace: str) -> TokenKey | None:
        return self._latest.get((namespace, session))

    def references(self, session: str) -> list[tuple[str, TokenKey]]:
        """The session's latest checkpoint in each namespace, as (namespace, tokens)."""
        return [(ns, key) for (ns, s), key in self._latest.items() if s == session]

    def usable_for(self, session: str, namespace: str, prompt: TokenKey) -> TokenKey | None:
        """The session's checkpoint if it is a usable prefix of `prompt` (<= len - 1), else None.

        Counts a hit or a fallback; a session without a reference counts nothing.
        """
        ref = self._latest.get((namespace, session))
        if ref is None:
            return None
        if ref.num_tokens < prompt.num_tokens and prompt.startswith(ref):
            self._hits += 1
            return ref
        self._fallbacks += 1
        return None

    def fallback(self) -> None:
        """A usable reference turned out not to be resident anywhere."""
        self._hits -= 1
        self._fallbacks += 1

    def referenced(self, namespace: str, tokens: Sequence[int] | np.ndarray | TokenKey) -> bool:
        """Does any session point at exactly this checkpoint?"""
        return (namespace, token_key(tokens)) in self._refs

    def close(self, session: str) -> bool:
        """Drop every reference of `session` (in every namespace); False if it is unknown."""
        mine = [k for k in self._latest if k[1] == session]
        for namespace, s in mine:
            self._unref(namespace, self._latest.pop((namespace, s)), s)
        self._closed += bool(mine)
        return bool(mine)

    def clear(self) -> None:
        self._latest.clear()
        self._refs.clear()

    def _unref(self, namespace: str, key: TokenKey, session: str) -> None:
        holders = self._refs.get((namespace, key))
        if holders is None:
            return
        holders.discard(session)
        if not holders:
            del self._refs[(namespace, key)]

    @property
    def stats(self) -> SessionStats:
        return SessionStats(len(self), len(self._refs), self._hits, self._fallbacks, self._closed)

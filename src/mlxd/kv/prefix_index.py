"""A radix tree from exact token sequences to values, for one cache namespace.

Edges are compressed: a node holds the whole run of tokens between two branch
points, packed as little-endian int32 `bytes` (4 bytes per token). A lookup
packs the prompt once and then compares each edge with one
`bytes.startswith(edge, offset)` call (a C memcmp, no copy); only the single
edge where the prompt diverges is scanned for the mismatch point, with numpy.

Memory: the tree holds each *distinct* token once (4 bytes, plus one node's
overhead per edge; measured in docs/benchmarks.md). Inserting a sequence copies only its unseen suffix;
a split copies the split edge into two halves and frees the original, so the
tree never pins a caller's buffers. Values are held by reference.

`longest_usable` runs in O(len(prompt)) byte comparisons plus O(nodes on the
path) dict look-ups, independent of the number of entries: every node keeps
the count of trimmable entries in its subtree and a pointer to the shortest
one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import numpy as np

TOKEN_BYTES = 4  # tokens are packed as little-endian int32
_INT32 = np.dtype("<i4")
_EMPTY: Any = object()  # marks a node that holds no value


class TokenKey(bytes):
    """A token sequence already packed as little-endian int32 bytes.

    Pack a prompt once with `token_key()` and pass the key to several index
    calls to skip re-packing.
    """

    __slots__ = ()

    @property
    def num_tokens(self) -> int:
        return len(self) // TOKEN_BYTES


def token_key(tokens: Sequence[int] | np.ndarray | TokenKey) -> TokenKey:
    """Pack tokens (list, tuple, numpy array) as int32 bytes; raises OverflowError past int32."""
    if isinstance(tokens, TokenKey):
        return tokens
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
        if tokens.dtype != _INT32:
            if tokens.size and (tokens.max() > 2**31 - 1 or tokens.min() < -(2**31)):
                raise OverflowError("token id does not fit in int32")
            tokens = tokens.astype(_INT32)
        return TokenKey(np.ascontiguousarray(tokens).tobytes())
    if isinstance(tokens, bytes | bytearray | str):
        raise TypeError("pass tokens as a sequence of ints or a TokenKey, not bytes/str")
    return TokenKey(np.fromiter(tokens, dtype=_INT32, count=len(tokens)).tobytes())


def key_tokens(key: bytes) -> tuple[int, ...]:
    """Unpack a key back into a tuple of ints."""
    return tuple(np.frombuffer(key, dtype=_INT32).tolist())


def _common_bytes(key: bytes, start: int, end: int, edge: bytes) -> int:
    """Bytes of `edge` that match `key[start:end]`, rounded down to whole tokens."""
    n = min(len(edge), end - start) // TOKEN_BYTES
    a = np.frombuffer(key, dtype=_INT32, count=n, offset=start)
    b = np.frombuffer(edge, dtype=_INT32, count=n)
    diff = np.flatnonzero(a != b)
    return (int(diff[0]) if diff.size else n) * TOKEN_BYTES


class _Node:
    """One radix-tree node: the edge from its parent and the subtree below."""

    __slots__ = (
        "edge",
        "parent",
        "children",
        "depth",
        "value",
        "trimmable",
        "trim_count",
        "shortest_trim",
    )

    def __init__(self, edge: bytes, parent: _Node | None, depth: int) -> None:
        self.edge = edge  # packed tokens from the parent to this node
        self.parent = parent
        self.children: dict[bytes, _Node] = {}  # keyed by the child's first packed token
        self.depth = depth  # tokens from the root to the end of this node's edge
        self.value: Any = _EMPTY
        self.trimmable = False
        self.trim_count = 0  # trimmable entries in this subtree (self included)
        self.shortest_trim: _Node | None = None  # shallowest trimmable entry in this subtree

    @property
    def has_value(self) -> bool:
        return self.value is not _EMPTY


@attrs.frozen
class IndexMatch:
    """The entry to reuse for a prompt and how many prompt tokens it can serve."""

    value: Any
    usable: int
    depth: int  # the entry's own length; usable < depth means the borrower trims


@attrs.frozen
class _Walk:
    """Where a key's path through the tree ends.

    `node` is the last node whose whole edge matched and `offset` the key bytes
    consumed there. If the key continues into a child's edge for `partial` more
    bytes (but not the whole edge), `child` is that child.
    """

    node: _Node
    offset: int
    child: _Node | None = None
    partial: int = 0


@attrs.define
class PrefixIndex:
    """Exact token sequences → values, with longest-usable-prefix lookups."""

    _root: _Node = attrs.field(factory=lambda: _Node(b"", None, 0), init=False)
    _size: int = attrs.field(default=0, init=False)

    def __len__(self) -> int:
        return self._size

    def _walk(self, key: bytes, end: int, found: list[_Node] | None = None) -> _Walk:
        """Follow key[:end] down the tree; append valued nodes passed to `found`."""
        node, off = self._root, 0
        while off < end:
            child = node.children.get(key[off : off + TOKEN_BYTES])
            if child is None:
                return _Walk(node, off)
            edge = child.edge
            if not key.startswith(edge, off, end):
                return _Walk(node, off, child, _common_bytes(key, off, end, edge))
            node, off = child, off + len(edge)
            if found is not None and node.has_value:
                found.append(node)
        return _Walk(node, off)

    def _find_node(self, key: bytes) -> _Node | None:
        walk = self._walk(key, len(key))
        if walk.child is None and walk.offset == len(key) and walk.node.has_value:
            return walk.node
        return None

    def get(self, tokens) -> Any | None:
        """The value stored under exactly these tokens, or None."""
        node = self._find_node(token_key(tokens))
        return None if node is None else node.value

    def __contains__(self, tokens) -> bool:
        return self._find_node(token_key(tokens)) is not None

    def insert(self, tokens, value: Any, *, trimmable: bool) -> Any | None:
        """Store `value` under exactly `tokens`; returns the value it replaced, or None."""
        key = token_key(tokens)
        node = self._node_for_insert(key)
        old = self._clear(node) if node.has_value else None
        node.value, node.trimmable = value, trimmable
        self._size += 1
        if trimmable:
            self._add_trimmable(node)
        return old

    def _node_for_insert(self, key: bytes) -> _Node:
        """The node that ends exactly at `key`, splitting or growing the tree as needed."""
        walk = self._walk(key, len(key))
        node, off = walk.node, walk.offset
        if walk.child is not None:
            node, off = self._split(walk.child, walk.partial), off + walk.partial
        if off == len(key):
            return node
        leaf = _Node(key[off:], node, node.depth + (len(key) - off) // TOKEN_BYTES)
        node.children[key[off : off + TOKEN_BYTES]] = leaf
        return leaf

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut child's edge after `at` bytes; returns the new middle node."""
        parent = child.parent
        assert parent is not None
        head, tail = child.edge[:at], child.edge[at:]
        mid = _Node(head, parent, parent.depth + at // TOKEN_BYTES)
        mid.trim_count, mid.shortest_trim = child.trim_count, child.shortest_trim
        parent.children[head[:TOKEN_BYTES]] = mid
        child.edge, child.parent = tail, mid
        mid.children[tail[:TOKEN_BYTES]] = child
        return mid

    def _add_trimmable(self, node: _Node) -> None:
        walker: _Node | None = node
        while walker is not None:
            walker.trim_count += 1
            best = walker.shortest_trim
            if best is None or node.depth < best.depth:
                walker.shortest_trim = node
            walker = walker.parent

    def _drop_trimmable(self, node: _Node) -> None:
        """Undo `_add_trimmable`; re-derive `shortest_trim` only where it pointed at node."""
        walker: _Node | None = node
        while walker is not None:
            walker.trim_count -= 1
            if walker.shortest_trim is node:
                walker.shortest_trim = self._shallowest_trimmable(walker)
            walker = walker.parent

    @staticmethod
    def _shallowest_trimmable(node: _Node) -> _Node | None:
        if node.has_value and node.trimmable:
            return node
        picks = [c.shortest_trim for c in node.children.values() if c.shortest_trim]
        return min(picks, key=lambda n: n.depth, default=None)

    def _clear(self, node: _Node) -> Any:
        """Take the value off a node (keeping the node); returns it."""
        value = node.value
        if node.trimmable:
            node.trimmable = False
            self._drop_trimmable(node)
        node.value = _EMPTY
        self._size -= 1
        return value

    def remove(self, tokens) -> Any | None:
        """Remove the entry stored under exactly `tokens`; returns its value, or None."""
        node = self._find_node(token_key(tokens))
        if node is None:
            return None
        value = self._clear(node)
        self._prune(node)
        return value

    def _prune(self, node: _Node) -> None:
        """Drop an empty leaf and merge valueless single-child nodes into their child."""
        parent = node.parent
        if parent is None:
            return
        if not node.children and not node.has_value:
            del parent.children[node.edge[:TOKEN_BYTES]]
            self._merge_with_child(parent)
        else:
            self._merge_with_child(node)

    def _merge_with_child(self, node: _Node) -> None:
        if node.parent is None or node.has_value or len(node.children) != 1:
            return
        (child,) = node.children.values()
        child.edge = node.edge + child.edge
        child.parent = node.parent
        node.parent.children[node.edge[:TOKEN_BYTES]] = child

    def longest_usable(self, prompt, *, limit: int) -> IndexMatch | None:
        """The entry that serves the most of prompt[:limit], or None.

        Candidates: an entry that is an exact prefix of prompt[:limit] serves
        its own length; a trimmable entry anywhere below the deepest point the
        prompt reaches (or below any earlier point on its path) serves the
        depth where it leaves the prompt. Ties prefer the exact entry, then
        the shortest trimmable one (least trim). Usable 0 is no match.
        """
        key = token_key(prompt)
        end = max(0, min(limit * TOKEN_BYTES, len(key)))
        found: list[_Node] = []
        walk = self._walk(key, end, found)
        exact = found[-1] if found else None
        trim, trim_usable = self._trimmable_candidate(walk)
        if exact is not None and exact.depth >= trim_usable:
            return IndexMatch(exact.value, exact.depth, exact.depth)
        if trim is not None and trim_usable > 0:
            return IndexMatch(trim.value, trim_usable, trim.depth)
        return None

    def diverging(self, prompt, *, at_most: int = 4) -> list[Any]:
        """Entries that leave the prompt's path where the prompt leaves the tree, nearest first.

        Whatever their kind: the candidates for re-aligning a re-tokenized prompt
        with a checkpoint that spells the same text in other ids (an untrimmable
        end-of-turn checkpoint after a restart is one). Bounded by `at_most`.
        """
        key = token_key(prompt)
        walk = self._walk(key, len(key))
        if walk.child is None and walk.node is self._root:
            return []  # nothing shared with the prompt
        roots = [walk.child] if walk.child is not None else list(walk.node.children.values())
        found: list[Any] = []
        queue = deque(roots)
        while queue and len(found) < at_most:
            node = queue.popleft()
            if node.has_value:
                found.append(node.value)
            queue.extend(node.children.values())
        return found

    def _trimmable_candidate(self, walk: _Walk) -> tuple[_Node | None, int]:
        """The shallowest trimmable entry below the deepest path point that has one."""
        if walk.child is not None and walk.child.shortest_trim is not None:
            return walk.child.shortest_trim, walk.node.depth + walk.partial // TOKEN_BYTES
        node: _Node | None = walk.node
        while node is not None and node.shortest_trim is None:
            node = node.parent  # climb: counts only shrink going down the path
        if node is None:
            return None, 0
        return node.shortest_trim, node.depth

    def strict_ancestors(self, tokens) -> list[Any]:
        """Values whose tokens are a strict prefix of `tokens`, shortest first."""
        key = token_key(tokens)
        found: list[_Node] = []
        self._walk(key, len(key), found)
        if self._root.has_value and key:
            found.insert(0, self._root)
        return [n.value for n in found if n.depth * TOKEN_BYTES < len(key)]

    def values(self) -> Iterator[Any]:
        """Every stored value, in depth-first order."""
        stack = [self._root]
        while stack:
            node = stack.pop()
            if node.has_value:
                yield node.value
            stack.extend(node.children.values())

    def items(self) -> Iterator[tuple[tuple[int, ...], Any]]:
        """(tokens, value) pairs; rebuilds each token tuple, so meant for tests and debugging."""
        stack: list[tuple[_Node, bytes]] = [(self._root, b"")]
        while stack:
            node, prefix = stack.pop()
            path = prefix + node.edge
            if node.has_value:
                yield key_tokens(path), node.value
            stack.extend((c, path) for c in node.children.values())

    def node_count(self) -> int:
        """Nodes in the tree (root included): the compression check."""
        count, stack = 0, [self._root]
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(node.children.values())
        return count

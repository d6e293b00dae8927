"""The block pool: physical block ids, reference counts, the free list and the prefix cache.

A block is *used* (reference count >= 1: mapped by that many sequences) or *free*. A free block
is either plain (on the free stack) or *cached*: it still holds the keys and values of a full
block registered under a key (a hash chain of its tokens, see :mod:`cupa.serving.prefix`) in one
of the pool's namespaces (one per layer group) and can be mapped again by a sequence whose prompt
starts with those tokens. Allocation takes plain blocks first and then evicts cached ones, least
recently freed first.

Every operation is O(1) per block (Python lists and an OrderedDict, no NumPy on this path). The
bookkeeping is O(num_blocks) memory.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterable, Optional

from ..errors import fail

__all__ = ["BlockPool"]


class BlockPool:
    """``num_blocks`` block ids with reference counts and a least-recently-used prefix cache.

    Parameters
    ----------
    num_blocks : int
        Blocks in the pool; ids are ``0 .. num_blocks - 1``.
    namespaces : int, default 1
        Independent prefix-cache tables (a key registered in one is unknown to the others).
    """

    def __init__(self, num_blocks: int, namespaces: int = 1):
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise fail("num_blocks", repr(num_blocks), "an int >= 0")
        if isinstance(namespaces, bool) or not isinstance(namespaces, int) or namespaces < 1:
            raise fail("namespaces", repr(namespaces), "an int >= 1")
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._key: list = [None] * num_blocks     # the key a block is registered under, or None
        self._space = bytearray(num_blocks)       # ... and its namespace
        self._plain = list(range(num_blocks - 1, -1, -1))   # free, uncached; pop() hands out 0, 1, 2, ...
        self._cached: OrderedDict = OrderedDict()           # free, cached; oldest first
        self._tables = [{} for _ in range(namespaces)]      # per namespace: key -> block

    # -- sizes -----------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation can take (plain free blocks and evictable cached ones)."""
        return len(self._plain) + len(self._cached)

    @property
    def num_used(self) -> int:
        """Blocks mapped by at least one sequence."""
        return self.num_blocks - len(self._plain) - len(self._cached)

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache (used or free)."""
        return sum(len(t) for t in self._tables)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def key_of(self, block: int) -> Optional[Hashable]:
        return self._key[block]

    # -- allocation ------------------------------------------------------------------------------------
    def _out_of_blocks(self, n: int) -> Exception:
        return fail("blocks", f"a request for {n} blocks with {self.num_free} free of {self.num_blocks}",
                    "at most the free blocks: finish or preempt a sequence, or give the cache more blocks")

    def allocate_one(self) -> int:
        """One block with reference count 1 (a plain free block, else the least recently freed cached one)."""
        if self._plain:
            block = self._plain.pop()
        elif self._cached:
            block, _ = self._cached.popitem(last=False)
            del self._tables[self._space[block]][self._key[block]]
            self._key[block] = None
        else:
            raise self._out_of_blocks(1)
        self._ref[block] = 1
        return block

    def allocate(self, n: int) -> list:
        """``n`` blocks, each with reference count 1; all or none (PagedAttentionError when fewer are free)."""
        if n > len(self._plain) + len(self._cached):
            raise self._out_of_blocks(n)
        return [self.allocate_one() for _ in range(n)]

    def share(self, block: int) -> None:
        """One more reference to a used block (a second sequence maps it)."""
        if self._ref[block] < 1:
            raise fail("block", f"{block} with reference count {self._ref[block]}", "a used block to share")
        self._ref[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block; a block left with none becomes free.

        A registered block becomes a cached free block (most recently freed); others return to the
        free stack. Freeing a block that is already free raises PagedAttentionError.
        """
        ref = self._ref
        for block in blocks:
            r = ref[block]
            if r < 1:
                raise fail("block", f"{block}, which is already free", "a used block (each reference freed once)")
            ref[block] = r - 1
            if r == 1:
                if self._key[block] is None:
                    self._plain.append(block)
                else:
                    self._cached[block] = None

    # -- prefix cache ----------------------------------------------------------------------------------
    def lookup(self, key: Hashable, namespace: int = 0) -> Optional[int]:
        """The block registered under ``key``, or None (no state change)."""
        return self._tables[namespace].get(key)

    def acquire(self, key: Hashable, namespace: int = 0) -> Optional[int]:
        """Map the block registered under ``key`` (reference count + 1; a cached free block becomes used)."""
        block = self._tables[namespace].get(key)
        if block is None:
            return None
        if self._ref[block] == 0:
            del self._cached[block]
        self._ref[block] += 1
        return block

    def register(self, block: int, key: Hashable, namespace: int = 0) -> bool:
        """Register a used, full block under ``key``.

        Returns True when the block is registered under ``key`` afterwards; False when another
        block already holds the key or the block holds another key (nothing changes then).
        """
        if self._ref[block] < 1:
            raise fail("block", f"{block} with reference count 0", "a used block to register")
        table = self._tables[namespace]
        if key in table:
            return table[key] == block
        if self._key[block] is not None:
            return False
        table[key] = block
        self._key[block] = key
        self._space[block] = namespace
        return True

    def register_many(self, blocks: list, keys: list, namespace: int = 0) -> None:
        """:meth:`register` for each (used block, key) pair; blocks < 0 (unmapped) are skipped."""
        table, key_of, space = self._tables[namespace], self._key, self._space
        for block, key in zip(blocks, keys):
            if block >= 0 and key_of[block] is None and table.setdefault(key, block) == block:
                key_of[block] = key
                space[block] = namespace

    def unregister(self, block: int) -> None:
        """Remove a used block from the prefix cache (its contents are about to change)."""
        key = self._key[block]
        if key is not None:
            del self._tables[self._space[block]][key]
            self._key[block] = None

    def clear_cache(self) -> None:
        """Drop every prefix-cache entry (cached free blocks become plain free blocks)."""
        for table in self._tables:
            for block in table.values():
                self._key[block] = None
            table.clear()
        self._plain.extend(self._cached)
        self._cached.clear()

    # -- checks ------------------------------------------------------------------------------------------
    def check(self) -> None:
        """Assert the pool's invariants (for tests): every block is exactly one of used, plain free,
        cached free; the prefix table and the per-block keys agree; cached free blocks are registered."""
        plain, cached = set(self._plain), set(self._cached)
        assert len(plain) == len(self._plain), "a block is on the free stack twice"
        assert not plain & cached, "a block is both plain and cached free"
        for b in range(self.num_blocks):
            free = b in plain or b in cached
            assert (self._ref[b] == 0) == free, f"block {b}: reference count {self._ref[b]}, free={free}"
            assert self._ref[b] >= 0
            if b in cached:
                assert self._key[b] is not None, f"cached free block {b} has no key"
            if b in plain:
                assert self._key[b] is None, f"plain free block {b} has key {self._key[b]!r}"
        assert self.num_cached == sum(k is not None for k in self._key)
        for space, table in enumerate(self._tables):
            for key, b in table.items():
                assert self._key[b] == key and self._space[b] == space, f"block {b}: key {self._key[b]!r} != {key!r}"

    def __repr__(self) -> str:
        return (f"BlockPool({self.num_blocks} blocks: {self.num_used} used, {len(self._plain)} free, "
                f"{len(self._cached)} cached free, {self.num_cached} registered)")

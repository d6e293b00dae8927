"""Block hashes for prefix sharing (vLLM-style automatic prefix caching).

A full block is named by a hash chain: ``h_i = hash_fn(h_{i-1}, tokens of block i as int64 bytes)``
with ``h_{-1}`` the root of the sequence (derived from its ``cache_salt``). Two sequences whose
first ``i + 1`` blocks hold the same tokens (after the same salt) get the same ``h_i``, so the
blocks of one can be mapped by the other. Each layer group registers its blocks in its own
namespace of the pool: groups never share blocks.

:func:`builtin_block_hash` (the default) is Python's 64-bit ``hash``: fast, and a collision maps
wrong keys and values into a sequence with probability about ``n**2 / 2**65`` for ``n`` cached
blocks. :func:`sha256_block_hash` is collision-proof in practice (cache_salt separates tenants)
and costs about 1 us a block more.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Hashable, Optional

__all__ = ["builtin_block_hash", "sha256_block_hash", "root_hash", "BlockHash"]

BlockHash = Callable[[Hashable, bytes], Hashable]


def builtin_block_hash(parent: Hashable, tokens: bytes) -> int:
    """``hash((parent, tokens))``: Python's 64-bit hash of the parent hash and the block's token bytes."""
    return hash((parent, tokens))


def sha256_block_hash(parent: Hashable, tokens: bytes) -> bytes:
    """SHA-256 of the parent's digest (or its repr) and the block's token bytes."""
    prefix = parent if isinstance(parent, bytes) else repr(parent).encode()
    return hashlib.sha256(prefix + tokens).digest()


def root_hash(cache_salt: Optional[Hashable]) -> Hashable:
    """The parent of block 0: None, or a value derived from the salt (sequences of different salts share nothing)."""
    return None if cache_salt is None else ("cupa.cache_salt", cache_salt)

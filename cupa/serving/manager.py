"""Sequences, steps, prefix sharing and rolling windows over one block pool.

:class:`KVCacheManager` keeps, for every running sequence, one *row*: its length, and per layer
group a row of a persistent host block table (``max_num_seqs x ceil(max_model_len / block_size)``
int32, indexed by absolute logical block, seed 9.3.1). Running sequences occupy rows
``0 .. num_running - 1`` (a finished sequence's row is refilled by the last one), so one step's
``block_table`` is the first ``B`` rows of that table as they are, and ``build_step`` is a handful
of NumPy operations over the rows and tokens: no Python loop per token or per sequence, only per
block that changes hands (a new block, an evicted block, a full block to hash).

A step's life::

    m.add("a", prompt)                     # prefix hits are mapped; returns the tokens already cached
    m.append("a", prompt[cached:chunk])    # a prompt chunk, k draft tokens, ...
    m.append_decode(sampled)               # one token for every running sequence
    step = m.build_step()                  # the op inputs (eviction of window blocks happens here)
    ... run the model: step.attention(op, layer, q, k, v) per layer ...
    m.rollback("a", rejected)              # speculative tokens that were not accepted
    m.finish("b")                          # or m.preempt("b"): blocks go back to the pool

Prefix sharing: full blocks are registered in the pool under the hash chain of their tokens (in
their layer group's namespace) when the step that writes them is built (any step that maps them is built later, so it
runs after the write on the stream). A block a sequence writes into is never shared: a hit maps
only full blocks, ``fork`` copies the partially filled last block (a device copy), and a rollback
into a shared block copies it first.
"""

from __future__ import annotations

import sys
from typing import Hashable, Optional, Sequence as _Seq

import numpy as np

from ..errors import fail
from .cache import KVCache
from .pool import BlockPool
from .prefix import BlockHash, builtin_block_hash, root_hash
from .step import Step

__all__ = ["KVCacheManager"]


class _Sequence:
    """Per-sequence state that is not in the row arrays."""

    __slots__ = ("id", "row", "alive", "root", "hashes", "recent")

    def __init__(self, seq_id, row: int, root):
        self.id = seq_id
        self.row = row
        self.alive = True
        self.root = root          # parent hash of block 0
        self.hashes: list = []    # hash chain of the full blocks, block i -> hashes[i]
        self.recent: dict = {}    # block index -> tokens (int64 bytes) of blocks a rollback may reopen


def _int(x, name: str, lo: int = 0) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < lo:
        raise fail(name, repr(x), f"an int >= {lo}")
    return int(x)


class KVCacheManager:
    """Block allocation and step inputs for the sequences served from one :class:`KVCache`.

    Parameters
    ----------
    cache : KVCache
        The cache (its layer groups, block size, block count and array library).
    max_num_seqs : int
        Running sequences at most (rows of the block tables; the batch capacity of fixed steps).
    max_model_len : int
        Longest sequence (positions); block tables have ``ceil(max_model_len / block_size)`` columns.
    max_num_batched_tokens : int, optional
        New tokens in one step at most (default ``max(max_num_seqs, max_model_len)``).
    enable_prefix_caching : bool, default True
        Register full blocks under the hash chain of their tokens and map them into new sequences
        whose prompts start with the same tokens. Token ids must then be given to ``append``.
    hash_fn : callable, optional
        ``hash_fn(parent, token_bytes) -> hashable``; default
        :func:`cupa.serving.builtin_block_hash` (see :mod:`cupa.serving.prefix`).
    """

    def __init__(self, cache: KVCache, *, max_num_seqs: int, max_model_len: int,
                 max_num_batched_tokens: Optional[int] = None, enable_prefix_caching: bool = True,
                 hash_fn: Optional[BlockHash] = None):
        if not isinstance(cache, KVCache):
            raise fail("cache", type(cache).__name__, "a cupa.serving.KVCache")
        self.cache = cache
        self.block_size = bs = cache.block_size
        self.groups = cache.groups
        self.pool = BlockPool(cache.num_blocks, namespaces=len(cache.groups))
        self.max_num_seqs = R = _int(max_num_seqs, "max_num_seqs", 1)
        self.max_model_len = _int(max_model_len, "max_model_len", 1)
        self.max_blocks = MB = -(-self.max_model_len // bs)
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(R, self.max_model_len)
        self.max_num_batched_tokens = T = _int(max_num_batched_tokens, "max_num_batched_tokens", 1)
        self.prefix_caching = bool(enable_prefix_caching)
        self.hash_fn = builtin_block_hash if hash_fn is None else hash_fn

        # per row
        self._computed = np.zeros(R, np.int32)   # tokens of built steps (the next step's past_seqlens)
        self._new = np.zeros(R, np.int32)        # tokens appended for the next step
        self._floor = np.zeros(R, np.int32)      # a rollback stops here (past_seqlens of the last step)
        self._rows: list = []                    # _Sequence per running row
        self._ids: list = []                     # seq id per running row
        self._seqs: dict = {}
        self._num_new = 0
        # per group and row
        G = len(self.groups)
        self._bt = [np.full((R, MB), -1, np.int32) for _ in range(G)]     # persistent block tables
        self._nmapped = [np.zeros(R, np.int32) for _ in range(G)]         # logical blocks assigned so far
        self._first = [np.zeros(R, np.int32) for _ in range(G)]           # first live block (window groups)
        self._write_from = [np.zeros(R, np.int32) for _ in range(G)]      # positions below are not written
        self._ring_n = [g.kind.ring_blocks(bs) if g.kind.policy == "ring" else 0 for g in self.groups]
        self._ring = [np.full((R, n), -1, np.int32) if n else None for n in self._ring_n]
        self._share = [g.index for g in self.groups if g.kind.shares_prefix]
        self._has_ring = any(self._ring_n)
        # prefix caching: the tokens of each row's partial block and of the block append_decode
        # filled last (what a rollback reopens); older blocks a rollback may reopen are in seq.recent
        P = R if self.prefix_caching else 0
        self._partial = np.zeros((P, bs), np.int64)
        self._prev_tokens = np.zeros((P, bs), np.int64)
        self._prev_index = np.full(P, -1, np.int32)
        self._pending: list = []                 # (sequence, i0, i1): full blocks to register at build
        self._pending_rows: list = []            # (rows, block indices, hashes, sequences) from append_decode
        self._rows_moved = False                 # a row changed hands or was rolled back since the last step
        self._recent: set = set()                # sequences with entries in seq.recent
        self._skip_writes = False                # some row has write_from > its length
        # step staging (host); padded values kept outside the live rows / tokens
        self._cum = np.zeros(R + 1, np.int32)
        self._past = np.zeros(R, np.int32)
        self._pos = np.full(T, -1, np.int32)
        self._slots = [np.full(T, -1, np.int32) for _ in range(G)]
        self._arange_r = np.arange(R)                   # row indices (intp: fast fancy indexing)
        self._arange_t = np.arange(T, dtype=np.int32)
        self._prev_b = 0
        self._prev_n = 0
        # device mirror of the staging (CuPy / CUDA torch), allocated on the first device step
        self._mirror = None
        self._dirty_rows = 0
        self._dirty_tokens = 0
        self._fixed_views: dict = {}

    # -- queries -----------------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self._rows)

    @property
    def seq_ids(self) -> list:
        """Running sequences in row (batch) order."""
        return list(self._ids)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take (free ones, cached ones included)."""
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        """Blocks mapped by at least one running sequence (a shared block counts once)."""
        return self.pool.num_used

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._seqs

    def _seq(self, seq_id) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            raise fail("seq_id", repr(seq_id), "a running sequence (added and not finished)") from None

    def length(self, seq_id) -> int:
        """Tokens of the sequence: built plus appended for the next step."""
        r = self._seq(seq_id).row
        return int(self._computed[r]) + int(self._new[r])

    def num_computed(self, seq_id) -> int:
        """Tokens of the sequence whose keys and values are in the cache once the built steps have run."""
        return int(self._computed[self._seq(seq_id).row])

    def block_table(self, seq_id, group: int = 0) -> np.ndarray:
        """The sequence's block-table row of ``group`` (a copy, up to its last mapped block)."""
        r = self._seq(seq_id).row
        return self._bt[group][r, :self._nmapped[group][r]].copy()

    def max_new_tokens(self, seq_id) -> int:
        """The most tokens ``append`` takes for the sequence now (model length, step budget, ring spans)."""
        r = self._seq(seq_id).row
        start = int(self._computed[r]) + int(self._new[r])
        n = min(self.max_model_len - start, self.max_num_batched_tokens - self._num_new)
        for g in self.groups:
            if g.kind.policy == "ring":
                lo = max(0, int(self._computed[r]) - g.kind.window + 1) // self.block_size
                n = min(n, (lo + self._ring_n[g.index]) * self.block_size - start)
        return max(0, n)

    def bookkeeping_bytes(self) -> int:
        """Host memory of the manager and its pool (the caches excluded): O(blocks + rows), no per-token state.

        NumPy arrays by their size; Python lists and dicts by ``sys.getsizeof`` plus 32 bytes per
        int or hash object they hold.
        """
        arrays = [self._computed, self._new, self._floor, self._cum, self._past, self._pos, *self._bt, *self._nmapped,
                  *self._first, *self._write_from, *self._slots, *[r for r in self._ring if r is not None],
                  self._partial, self._prev_tokens, self._prev_index]
        n = sum(a.nbytes for a in arrays)
        pool = self.pool
        n += sys.getsizeof(pool._ref) + sys.getsizeof(pool._key) + len(pool._space)
        n += sys.getsizeof(pool._plain) + 32 * len(pool._plain) + sys.getsizeof(pool._cached) + 32 * len(pool._cached)
        n += sum(sys.getsizeof(t) + 32 * len(t) for t in pool._tables)
        for seq in self._rows:
            n += sys.getsizeof(seq.hashes) + 32 * len(seq.hashes) + sys.getsizeof(seq.recent)
            n += sum(len(v) for v in seq.recent.values())
        return n

    # -- tokens --------------------------------------------------------------------------------------------
    def _token_ids(self, tokens, name: str = "tokens") -> Optional[np.ndarray]:
        if tokens is None:
            return None
        ids = np.array(tokens, dtype=np.int64, copy=True)
        if ids.ndim != 1:
            raise fail(name, f"shape {ids.shape}", "a 1-D sequence of token ids")
        return ids

    def _complete_blocks(self, seq: _Sequence, i: int, blocks: list) -> None:
        """Blocks ``i, i + 1, ...`` of ``seq`` are full with the tokens (int64 bytes) in ``blocks``:
        extend the hash chain, queue their registration, keep their tokens until the next step."""
        hashes = seq.hashes
        parent = hashes[-1] if hashes else seq.root
        fn = self.hash_fn
        for tokens in blocks:
            parent = fn(parent, tokens)
            hashes.append(parent)
        seq.recent.update(zip(range(i, i + len(blocks)), blocks))
        self._recent.add(seq)
        self._pending.append((seq, i, i + len(blocks)))

    def _decode_blocks_filled(self, rows: np.ndarray, blocks: np.ndarray) -> None:
        """append_decode filled block ``blocks[k]`` of row ``rows[k]`` (vectorized over the rows)."""
        bs = self.block_size
        # the block filled before is overwritten below; keep it where a rollback may still reopen it
        for k in np.nonzero(self._prev_index[rows] >= self._floor[rows] // bs)[0].tolist():
            r = int(rows[k])
            seq = self._rows[r]
            seq.recent[int(self._prev_index[r])] = self._prev_tokens[r].tobytes()
            self._recent.add(seq)
        tokens = self._partial[rows]
        self._prev_tokens[rows] = tokens
        self._prev_index[rows] = blocks
        fn, seqs = self.hash_fn, self._rows
        added, owners = [], []
        for r, t in zip(rows.tolist(), tokens):
            seq = seqs[r]
            hashes = seq.hashes
            hashes.append(fn(hashes[-1] if hashes else seq.root, t.tobytes()))
            added.append(hashes[-1])
            owners.append(seq)
        self._pending_rows.append((rows, blocks, added, owners))

    def _fill_tokens(self, seq: _Sequence, start: int, ids: np.ndarray) -> None:
        bs = self.block_size
        partial = self._partial[seq.row]
        off = start % bs
        n = len(ids)
        if off + n < bs:
            partial[off:off + n] = ids
            return
        k = bs - off
        full = (n - k) // bs
        data = ids[k:k + full * bs].tobytes()
        width = bs * 8
        blocks = [partial[:off].tobytes() + ids[:k].tobytes()]
        blocks += [data[j * width:(j + 1) * width] for j in range(full)]
        self._complete_blocks(seq, start // bs, blocks)
        pos = k + full * bs
        partial[:n - pos] = ids[pos:]

    # -- sequences -----------------------------------------------------------------------------------------
    def add(self, seq_id: Hashable, tokens=None, *, cache_salt: Optional[Hashable] = None) -> int:
        """Start a sequence; with prefix caching, map the cached blocks its prompt starts with.

        Parameters
        ----------
        seq_id : hashable
            A name not in use by a running sequence.
        tokens : 1-D sequence of int, optional
            The prompt's token ids (needed for a prefix hit; not appended: send
            ``tokens[cached:]`` through :meth:`append`).
        cache_salt : hashable, optional
            Sequences share cached blocks only with sequences of the same salt.

        Returns
        -------
        cached : int
            Prompt tokens already in the cache (a multiple of block_size, at most
            ``len(tokens) - 1``): the sequence starts with that length.
        """
        self._check_new(seq_id, "seq_id")
        ids = self._token_ids(tokens)
        if ids is not None and len(ids) > self.max_model_len:
            raise fail("tokens", f"a prompt of {len(ids)} tokens", f"at most max_model_len={self.max_model_len}")
        row = len(self._rows)
        seq = _Sequence(seq_id, row, root_hash(cache_salt))
        cached = 0
        if self.prefix_caching and ids is not None and len(ids) > self.block_size and self._share:
            cached = self._map_prefix(seq, ids)
        self._rows.append(seq)
        self._ids.append(seq_id)
        self._seqs[seq_id] = seq
        self._computed[row] = cached
        self._new[row] = 0
        self._floor[row] = cached
        if self.prefix_caching:
            self._prev_index[row] = -1
        return cached

    def _check_new(self, seq_id, name: str) -> None:
        """A new sequence named ``seq_id`` may start: a free name, a free row."""
        try:
            taken = seq_id in self._seqs
        except TypeError:
            raise fail(name, type(seq_id).__name__, "a hashable name") from None
        if taken:
            raise fail(name, repr(seq_id), "a name not used by a running sequence")
        if len(self._rows) >= self.max_num_seqs:
            raise fail("sequences", f"{len(self._rows)} running", f"fewer than max_num_seqs={self.max_num_seqs} "
                       "to start one: finish or preempt a sequence first")

    def _map_prefix(self, seq: _Sequence, ids: np.ndarray) -> int:
        """Find and map the cached blocks of a prompt (see :meth:`add`); returns the tokens cached."""
        bs, pool, row = self.block_size, self.pool, seq.row
        max_hit = (len(ids) - 1) // bs
        data = ids[:max_hit * bs].tobytes()
        hashes: list = []

        def chain(i):   # hashes[i], extending the chain lazily
            while len(hashes) <= i:
                k = len(hashes)
                parent = hashes[-1] if hashes else seq.root
                hashes.append(self.hash_fn(parent, data[k * bs * 8:(k + 1) * bs * 8]))
            return hashes[i]

        keep = [g.index for g in self.groups if g.kind.policy == "keep"]
        evict = [g.index for g in self.groups if g.kind.policy == "evict"]
        runs = {}
        for g in keep:
            i = 0
            while i < max_hit and pool.lookup(chain(i), g) is not None:
                i += 1
            runs[g] = i
        limit = min(runs.values()) if runs else max_hit
        hit = 0
        if not self._has_ring:
            hit = limit
            if evict and limit:
                present = [np.array([pool.lookup(chain(i), g) is not None for i in range(limit)]) for g in evict]
                windows = [self.groups[g].kind.window for g in evict]
                while hit > 0:
                    if all(p[max(0, hit * bs - w + 1) // bs:hit].all() for p, w in zip(present, windows)):
                        break
                    hit -= 1
        for g in keep:
            n = runs[g]
            blocks = [pool.acquire(hashes[i], g) for i in range(n)]
            self._bt[g][row, :n] = blocks
            self._nmapped[g][row] = n
            self._first[g][row] = 0
            self._write_from[g][row] = n * bs
            if n > hit:
                self._skip_writes = True
        for g in evict:
            lo = max(0, hit * bs - self.groups[g].kind.window + 1) // bs
            self._bt[g][row, lo:hit] = [pool.acquire(hashes[i], g) for i in range(lo, hit)]
            self._nmapped[g][row] = hit
            self._first[g][row] = lo
            self._write_from[g][row] = hit * bs
        for g, n in enumerate(self._ring_n):
            if n:
                self._nmapped[g][row] = 0
                self._first[g][row] = 0
                self._write_from[g][row] = 0
        seq.hashes = hashes[:hit]
        return hit * bs

    def _reset_row_state(self, row: int) -> None:
        for g in range(len(self.groups)):
            self._nmapped[g][row] = 0
            self._first[g][row] = 0
            self._write_from[g][row] = 0

    def append(self, seq_id: Hashable, tokens) -> None:
        """Append new tokens to one sequence for the next step (a prompt chunk, a decoded token, drafts).

        Parameters
        ----------
        seq_id : hashable
        tokens : 1-D sequence of int, or int
            Token ids; a count is enough without prefix caching.

        Allocates the blocks the tokens need in every group (all or nothing: PagedAttentionError
        when the pool is short, leaving the state as it was).
        """
        seq = self._seq(seq_id)
        r = seq.row
        if isinstance(tokens, (int, np.integer)) and not isinstance(tokens, bool):
            if self.prefix_caching:
                raise fail("tokens", "a token count", "token ids (prefix caching hashes them)")
            ids, n = None, _int(tokens, "tokens")
        else:
            ids = self._token_ids(tokens)
            n = len(ids)
        if n == 0:
            return
        bs = self.block_size
        computed = int(self._computed[r])
        start = computed + int(self._new[r])
        end = start + n
        if end > self.max_model_len:
            raise fail("tokens", f"{n} more tokens for a sequence of {start}", f"at most max_model_len="
                       f"{self.max_model_len} in all")
        if self._num_new + n > self.max_num_batched_tokens:
            raise fail("tokens", f"{n} more tokens for a step of {self._num_new}",
                       f"at most max_num_batched_tokens={self.max_num_batched_tokens} in one step")
        last = (end - 1) // bs
        need = 0
        for g in self.groups:
            gi = g.index
            nm = int(self._nmapped[gi][r])
            if self._ring_n[gi]:
                N = self._ring_n[gi]
                lo = max(0, computed - g.kind.window + 1) // bs
                if last - lo + 1 > N:
                    raise fail("tokens", f"{n} tokens at position {start} of a ring-buffer window group",
                               f"at most {(lo + N) * bs - start} (the ring of {N} blocks holds window "
                               f"{g.kind.window} plus max_query_len={g.kind.max_query_len} new tokens): append "
                               "fewer tokens per step or raise LayerKind.max_query_len")
                ring = self._ring[gi][r]
                need += len({i % N for i in range(nm, last + 1) if ring[i % N] < 0})
            else:
                need += max(0, last + 1 - nm)
        if need > self.pool.num_free:
            raise self.pool._out_of_blocks(need)
        for g in self.groups:
            gi = g.index
            nm = int(self._nmapped[gi][r])
            if nm > last:
                continue
            bt = self._bt[gi][r]
            if self._ring_n[gi]:
                N, ring = self._ring_n[gi], self._ring[gi][r]
                for i in range(nm, last + 1):
                    if ring[i % N] < 0:
                        ring[i % N] = self.pool.allocate_one()
                    bt[i] = ring[i % N]
            else:
                bt[nm:last + 1] = self.pool.allocate(last + 1 - nm)
            self._nmapped[gi][r] = last + 1
        if ids is not None and self.prefix_caching:
            self._fill_tokens(seq, start, ids)
        self._new[r] += n
        self._num_new += n

    def append_decode(self, tokens=None, seq_ids: Optional[_Seq] = None) -> None:
        """Append one token to each of many sequences (the decode step), vectorized over the rows.

        Parameters
        ----------
        tokens : 1-D sequence of int, optional
            One token id per sequence (required with prefix caching).
        seq_ids : sequence, or bool ndarray of shape (num_running,), optional
            The sequences, default every running sequence in row order (:attr:`seq_ids`); a boolean
            mask over the rows in that order picks them without a lookup per sequence.
        """
        B = len(self._rows)
        if seq_ids is None:
            rows, sel = self._arange_r[:B], slice(0, B)
        elif isinstance(seq_ids, np.ndarray) and seq_ids.dtype == np.bool_:
            if seq_ids.shape != (B,):
                raise fail("seq_ids", f"a boolean mask of shape {seq_ids.shape}", f"shape ({B},): one entry per running row")
            rows = sel = self._arange_r[:B][seq_ids]
        else:
            rows = np.fromiter((self._seq(s).row for s in seq_ids), dtype=np.intp)
            if len(np.unique(rows)) != len(rows):
                raise fail("seq_ids", "a sequence listed twice", "each sequence once")
            sel = rows
        m = len(rows)
        if m == 0:
            return
        ids = None
        if tokens is not None:
            ids = np.asarray(tokens, dtype=np.int64)
            if ids.shape != (m,):
                raise fail("tokens", f"shape {ids.shape}", f"({m},): one token per sequence")
        elif self.prefix_caching:
            raise fail("tokens", "None", "one token id per sequence (prefix caching hashes them)")
        bs = self.block_size
        computed = self._computed[sel]
        start = computed + self._new[sel]
        if int(start.max()) >= self.max_model_len:
            raise fail("tokens", "a token for a sequence of max_model_len tokens",
                       f"sequences shorter than max_model_len={self.max_model_len}")
        if self._num_new + m > self.max_num_batched_tokens:
            raise fail("tokens", f"{m} more tokens for a step of {self._num_new}",
                       f"at most max_num_batched_tokens={self.max_num_batched_tokens} in one step")
        blk = start // bs
        plans, need = [], 0
        for g in self.groups:
            gi = g.index
            enter = np.nonzero(self._nmapped[gi][sel] <= blk)[0]
            if self._ring_n[gi]:
                N = self._ring_n[gi]
                lo = np.maximum(computed - g.kind.window + 1, 0) // bs
                if (blk - lo + 1 > N).any():
                    raise fail("tokens", "a token past the ring of a window group",
                               f"a ring of {N} blocks per sequence: raise LayerKind.max_query_len")
                if len(enter):
                    need += int((self._ring[gi][rows[enter], blk[enter] % N] < 0).sum())
            else:
                need += len(enter)
            plans.append(enter)
        if need > self.pool.num_free:
            raise self.pool._out_of_blocks(need)
        allocate = self.pool.allocate_one
        for g, enter in zip(self.groups, plans):
            if not len(enter):
                continue
            gi = g.index
            bt, nmapped, N = self._bt[gi], self._nmapped[gi], self._ring_n[gi]
            for r, i in zip(rows[enter].tolist(), blk[enter].tolist()):
                if N:
                    ring = self._ring[gi][r]
                    if ring[i % N] < 0:
                        ring[i % N] = allocate()
                    bt[r, i] = ring[i % N]
                else:
                    bt[r, i] = allocate()
                nmapped[r] = i + 1
        if ids is not None and self.prefix_caching:
            off = start % bs
            self._partial[rows, off] = ids
            done = np.nonzero(off == bs - 1)[0]
            if len(done):
                self._decode_blocks_filled(rows[done], blk[done])
        self._new[sel] += 1
        self._num_new += m

    def _free_row(self, r: int) -> None:
        """Return every block of row r to the pool (tail blocks first: they are evicted first)."""
        free = self.pool.free
        for g in self.groups:
            gi = g.index
            nm = int(self._nmapped[gi][r])
            if self._ring_n[gi]:
                ring = self._ring[gi][r]
                free([int(b) for b in ring[::-1] if b >= 0])
                ring[:] = -1
            else:
                seg = self._bt[gi][r, int(self._first[gi][r]):nm]
                free([int(b) for b in seg[::-1] if b >= 0])
            self._bt[gi][r, :nm] = -1

    def _release_row(self, seq: _Sequence) -> None:
        """Drop ``seq``'s row; the last running row moves into it."""
        r = seq.row
        last = len(self._rows) - 1
        self._num_new -= int(self._new[r])
        self._rows_moved = True
        seq.alive = False
        seq.row = -1
        del self._seqs[seq.id]
        if r != last:
            moved = self._rows[last]
            for a in (self._computed, self._new, self._floor, *self._nmapped, *self._first, *self._write_from):
                a[r] = a[last]
            for gi, bt in enumerate(self._bt):
                nm = int(self._nmapped[gi][last])
                bt[r, :nm] = bt[last, :nm]
                bt[last, :nm] = -1
                if self._ring[gi] is not None:
                    self._ring[gi][r] = self._ring[gi][last]
                    self._ring[gi][last] = -1
            if self.prefix_caching:
                for a in (self._partial, self._prev_tokens, self._prev_index):
                    a[r] = a[last]
            moved.row = r
            self._rows[r] = moved
            self._ids[r] = moved.id
        self._rows.pop()
        self._ids.pop()
        self._computed[last] = self._new[last] = self._floor[last] = 0
        self._reset_row_state(last)

    def finish(self, seq_id: Hashable) -> None:
        """End a sequence: its blocks go back to the pool (registered ones stay in the prefix cache)."""
        seq = self._seq(seq_id)
        self._free_row(seq.row)
        self._release_row(seq)

    def preempt(self, seq_id: Hashable) -> int:
        """Stop a sequence and return its blocks; returns its length (the tokens to recompute).

        Resume it with ``add(seq_id, all_its_tokens)`` (its own registered blocks may still be
        cached) and append the tokens past the returned hit.
        """
        length = self.length(seq_id)
        self.finish(seq_id)
        return length

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Start ``child_id`` as a copy of ``parent_id`` (parallel sampling, beam search).

        Full blocks are shared (reference counts); the partially filled last block, and the blocks
        of a ring, are copied to new blocks by a device copy (``cache.copy_blocks``), so neither
        sequence ever writes a block the other reads. The parent's appended tokens must have been
        built first.
        """
        parent = self._seq(parent_id)
        self._check_new(child_id, "child_id")
        rp = parent.row
        if self._new[rp]:
            raise fail("parent_id", f"a sequence with {int(self._new[rp])} appended tokens not yet built",
                       "a sequence whose tokens have all been built (fork after build_step)")
        bs = self.block_size
        length = int(self._computed[rp])
        copy_plan = []
        for g in self.groups:
            gi = g.index
            if self._ring_n[gi]:
                copy_plan.append([k for k, b in enumerate(self._ring[gi][rp]) if b >= 0])
            else:
                wf = int(self._write_from[gi][rp])
                i = length // bs
                written = length % bs and wf <= length and self._bt[gi][rp, i] >= 0
                copy_plan.append([i] if written else [])
        need = sum(len(p) for p in copy_plan)
        if need > self.pool.num_free:
            raise self.pool._out_of_blocks(need)
        rc = len(self._rows)
        child = _Sequence(child_id, rc, parent.root)
        child.hashes = list(parent.hashes)
        child.recent = dict(parent.recent)
        if child.recent:
            self._recent.add(child)
        src, dst = [], []
        for g, plan in zip(self.groups, copy_plan):
            gi = g.index
            nm = int(self._nmapped[gi][rp])
            self._nmapped[gi][rc] = nm
            self._first[gi][rc] = self._first[gi][rp]
            self._write_from[gi][rc] = self._write_from[gi][rp]
            bt_p, bt_c = self._bt[gi][rp], self._bt[gi][rc]
            if self._ring_n[gi]:
                N = self._ring_n[gi]
                ring_p, ring_c = self._ring[gi][rp], self._ring[gi][rc]
                for k in plan:
                    ring_c[k] = self.pool.allocate_one()
                    src.append(int(ring_p[k]))
                    dst.append(int(ring_c[k]))
                for i in range(int(self._first[gi][rp]), nm):
                    if bt_p[i] >= 0:
                        bt_c[i] = ring_c[i % N]
            else:
                bt_c[:nm] = bt_p[:nm]
                for i in range(int(self._first[gi][rp]), nm):
                    if bt_p[i] >= 0 and i not in plan:
                        self.pool.share(int(bt_p[i]))
                for i in plan:
                    bt_c[i] = self.pool.allocate_one()
                    src.append(int(bt_p[i]))
                    dst.append(int(bt_c[i]))
        self.cache.copy_blocks(src, dst)
        if any(int(wf[rc]) > length for wf in self._write_from):
            self._skip_writes = True
        self._computed[rc] = length
        self._new[rc] = 0
        self._floor[rc] = length
        if self.prefix_caching:
            for a in (self._partial, self._prev_tokens, self._prev_index):
                a[rc] = a[rp]
        self._rows.append(child)
        self._ids.append(child_id)
        self._seqs[child_id] = child

    def rollback(self, seq_id: Hashable, num_tokens: int) -> None:
        """Remove the last ``num_tokens`` tokens of a sequence (rejected speculative tokens).

        The tokens may be those of the last built step or appended since; the sequence's
        lengths and block tables return to what they were without them, blocks past the new end
        go back to the pool, and their slots are written again by the next tokens. A full block
        that becomes partial leaves the prefix cache (or is copied first if another sequence
        maps it).
        """
        seq = self._seq(seq_id)
        r = seq.row
        n = _int(num_tokens, "num_tokens")
        computed, new = int(self._computed[r]), int(self._new[r])
        length = computed + new
        floor = int(self._floor[r])
        if length - n < floor:
            raise fail("num_tokens", n, f"at most {length - floor}: the tokens of the sequence's last step "
                       "and those appended since")
        if n == 0:
            return
        bs, pool = self.block_size, self.pool
        self._rows_moved = True
        new_len = length - n
        keep = -(-new_len // bs)
        pb = new_len // bs if new_len % bs else -1
        # copies needed (a shared block that becomes partial) against blocks this rollback frees
        need = freed = 0
        for g in self.groups:
            gi = g.index
            if self._ring_n[gi]:
                continue
            seg = self._bt[gi][r, keep:int(self._nmapped[gi][r])]
            freed += sum(1 for b in seg if b >= 0 and pool.ref_count(int(b)) == 1)
            if pb >= 0 and self._bt[gi][r, pb] >= 0 and pool.ref_count(int(self._bt[gi][r, pb])) > 1:
                need += 1
        if need > pool.num_free + freed:
            raise pool._out_of_blocks(need)
        if n <= new:
            self._new[r] = new - n
        else:
            self._new[r] = 0
            self._computed[r] = new_len
        self._num_new -= min(n, new)
        src, dst = [], []
        for g in self.groups:
            gi = g.index
            nm = int(self._nmapped[gi][r])
            bt = self._bt[gi][r]
            if self._ring_n[gi]:
                if nm > keep:
                    bt[keep:nm] = -1
                    self._nmapped[gi][r] = keep
                continue
            if nm > keep:
                seg = bt[keep:nm]
                pool.free([int(b) for b in seg[::-1] if b >= 0])
                seg[:] = -1
                self._nmapped[gi][r] = keep
            if self._write_from[gi][r] > new_len:
                self._write_from[gi][r] = new_len
            if pb >= 0 and bt[pb] >= 0:
                b = int(bt[pb])
                if pool.ref_count(b) > 1:
                    nb = pool.allocate_one()
                    src.append(b)
                    dst.append(nb)
                    pool.free([b])
                    bt[pb] = nb
                else:
                    pool.unregister(b)
        self.cache.copy_blocks(src, dst)
        if self.prefix_caching:
            nfull = new_len // bs
            del seq.hashes[nfull:]
            if pb >= 0 and pb != length // bs:
                if pb in seq.recent:
                    tokens = np.frombuffer(seq.recent[pb], np.int64)
                else:
                    assert self._prev_index[r] == pb, "the tokens of a reopened block were not kept"
                    tokens = self._prev_tokens[r]
                self._partial[r, :new_len % bs] = tokens[:new_len % bs]
            if seq.recent:
                seq.recent = {k: v for k, v in seq.recent.items() if k < nfull}
            if self._prev_index[r] >= nfull:
                self._prev_index[r] = -1

    # -- steps -----------------------------------------------------------------------------------------------
    def _evict_windows(self, B: int, past: np.ndarray) -> None:
        """Seed 9.3.2: blocks below ``max(0, past - W + 1) // block_size`` are unreachable from now on
        (-1 in the table; an evicting group frees them). Vectorized over the rows whose window moved."""
        bs, MB = self.block_size, self.max_blocks
        for g in self.groups:
            if not g.kind.is_window or g.kind.policy == "keep":
                continue
            gi = g.index
            first = self._first[gi][:B]
            new_first = np.maximum(past - (g.kind.window - 1), 0) // bs
            moved = np.flatnonzero(new_first > first)
            if not moved.size:
                continue
            lo, hi = first[moved], new_first[moved]
            counts = hi - lo
            if int(counts.max()) == 1:                 # the common case: one block leaves each window
                flat = np.multiply(moved, MB, dtype=np.intp) + lo
            else:
                rows = np.repeat(moved, counts)
                cols = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts - lo, counts)
                flat = np.multiply(rows, MB, dtype=np.intp) + cols
            bt = self._bt[gi].reshape(-1)
            if g.kind.policy == "evict":
                gone = bt[flat]
                self.pool.free(gone[gone >= 0].tolist())
            bt[flat] = -1
            first[moved] = hi

    def _register_pending(self) -> None:
        """Register the full blocks of the step just built (their hashes as they are now)."""
        register, share = self.pool.register_many, self._share
        for seq, i0, i1 in self._pending:
            if not seq.alive:
                continue
            hashes, row = seq.hashes[i0:i1], seq.row
            for gi in share:
                register(self._bt[gi][row, i0:i0 + len(hashes)].tolist(), hashes, gi)
        for rows, blocks, hashes, owners in self._pending_rows:
            if self._rows_moved:   # a finish or rollback since append_decode: keep the entries still standing
                live = [(s.row, i, h) for s, i, h in zip(owners, blocks.tolist(), hashes)
                        if s.alive and i < len(s.hashes) and s.hashes[i] is h]
                if not live:
                    continue
                rows, blocks, hashes = (list(x) for x in zip(*live))
            for gi in share:
                register(self._bt[gi][rows, blocks].tolist(), hashes, gi)
        self._pending.clear()
        self._pending_rows.clear()
        self._rows_moved = False

    def _trim_recent(self) -> None:
        """Forget the tokens of full blocks below each sequence's rollback floor."""
        bs = self.block_size
        for seq in list(self._recent):
            if seq.alive:
                floor_block = int(self._floor[seq.row]) // bs
                seq.recent = {k: v for k, v in seq.recent.items() if k >= floor_block}
            else:
                seq.recent = {}
            if not seq.recent:
                self._recent.discard(seq)

    def build_step(self, *, fixed: bool = False, batch_size: Optional[int] = None,
                   token_count: Optional[int] = None, max_query_len: Optional[int] = None) -> Step:
        """The op inputs of the next step: every running sequence, with the tokens appended to it.

        Rows with no new token stay in the batch (a sequence with zero tokens writes and outputs
        nothing). Window groups evict first (seed 9.3.2). Full blocks the step fills are
        registered for prefix sharing.

        Parameters
        ----------
        fixed : bool, default False
            Fixed-capacity arrays for CUDA-graph replay (:func:`cupa.capture_graph`): the same
            arrays (device pointers) at every step of one ``(batch_size, token_count)``; rows past
            the live ones have ``cum[b+1] = cum[b] = N``, ``past_seqlens = 0`` and block-table rows
            of -1; tokens past N have slot -1 and position -1; ``attention_metadata`` is the
            replay-wide ``[max_query_len, max_model_len]``.
        batch_size, token_count : int, optional
            fixed only: the capacity (default ``max_num_seqs`` and ``max_num_batched_tokens``).
        max_query_len : int, optional
            fixed only: the replay-wide bound on one sequence's new tokens (default
            ``token_count``; 1 for a decode graph).

        Returns
        -------
        Step
        """
        B, N = len(self._rows), self._num_new
        q = self._new[:B]
        if fixed:
            bcap = self.max_num_seqs if batch_size is None else _int(batch_size, "batch_size", 1)
            ncap = self.max_num_batched_tokens if token_count is None else _int(token_count, "token_count", 1)
            mql = ncap if max_query_len is None else _int(max_query_len, "max_query_len", 1)
            if bcap > self.max_num_seqs or ncap > self.max_num_batched_tokens:
                raise fail("batch_size/token_count", f"({bcap}, {ncap})", f"at most (max_num_seqs, "
                           f"max_num_batched_tokens) = ({self.max_num_seqs}, {self.max_num_batched_tokens})")
            if B > bcap or N > ncap:
                raise fail("step", f"{B} sequences and {N} tokens", f"at most batch_size={bcap} sequences and "
                           f"token_count={ncap} tokens for these fixed buffers")
            if B and int(q.max()) > mql:
                raise fail("step", f"a sequence with {int(q.max())} new tokens",
                           f"at most max_query_len={mql} (the replay-wide bound)")
        elif batch_size is not None or token_count is not None or max_query_len is not None:
            raise fail("batch_size/token_count/max_query_len", "a capacity without fixed=True",
                       "fixed=True to size fixed-capacity buffers")
        bs = self.block_size
        past = self._past
        past[:B] = self._computed[:B]
        self._evict_windows(B, past[:B])
        cum = self._cum
        np.cumsum(q, out=cum[1:B + 1])
        cum[B + 1:] = N
        pos = self._pos
        decode = N == B and (B == 0 or int(q.max()) == 1)
        if decode:
            owner = self._arange_r[:B]
            pos[:N] = past[:B]
        else:
            owner = np.repeat(self._arange_r[:B], q)
            pos[:N] = self._arange_t[:N] - cum[owner] + past[owner]
        p = pos[:N]
        flat = np.multiply(owner, self.max_blocks, dtype=np.intp) + p // bs   # (row, logical block), flattened
        off = p % bs
        skip = self._skip_writes
        for gi, bt in enumerate(self._bt):
            s = self._slots[gi]
            np.take(bt.reshape(-1), flat, out=s[:N])
            s[:N] *= bs
            s[:N] += off
            if skip:
                s[:N][p < self._write_from[gi][owner]] = -1
            if self._prev_n > N:
                s[N:self._prev_n] = -1
        if self._prev_n > N:
            pos[N:self._prev_n] = -1
        if self._prev_b > B:
            past[B:self._prev_b] = 0
        seq_lens = past[:B] + q
        if fixed:
            key = (bcap, ncap, mql)
            md = self._fixed_views.get(("md",) + key)
            if md is None:
                md = self._fixed_views[("md",) + key] = np.array([mql, self.max_model_len], np.int32)
        else:
            md = np.array([int(q.max()), int(seq_lens.max())] if B else [0, 0], np.int32)
        query_lens = q.copy()
        logits_indices = np.where(query_lens > 0, cum[1:B + 1] - 1, -1).astype(np.int32)
        # the step is built: advance the rows
        self._floor[:B] = past[:B]
        self._computed[:B] += q
        q[:] = 0
        self._num_new = 0
        self._prev_b, self._prev_n = B, N
        if skip:
            self._skip_writes = any(bool((wf[:B] > self._computed[:B]).any()) for wf in self._write_from)
        if self._pending or self._pending_rows:
            self._register_pending()
        if self._recent:
            self._trim_recent()
        arrays = self._place(B, N, bcap if fixed else None, ncap if fixed else None)
        return Step(list(self._ids), B, N, *arrays, md, query_lens, seq_lens, logits_indices, self.cache)

    def _place(self, B: int, N: int, bcap: Optional[int], ncap: Optional[int]) -> tuple:
        """(cum, past, positions, block tables, slot mappings) on the cache's library and device."""
        lib = self.cache.lib
        fixed = bcap is not None
        rows, toks = (bcap, ncap) if fixed else (B, N)
        if lib.name == "numpy" or (lib.name == "torch" and not lib.on_gpu):
            if fixed:
                key = ("host", bcap, ncap)
                views = self._fixed_views.get(key)
                if views is None:
                    views = self._fixed_views[key] = self._views(self._host_arrays(), bcap, ncap)
                return views
            return self._views(self._host_arrays(), B, N)
        mirror = self._device_mirror()
        hi_rows, hi_toks = max(B, self._dirty_rows), max(N, self._dirty_tokens)
        copy = lib.copy_from_host
        copy(mirror[0], self._cum[:max(rows, hi_rows) + 1])
        copy(mirror[1], self._past[:hi_rows])
        copy(mirror[2], self._pos[:hi_toks])
        for gi in range(len(self.groups)):
            copy(mirror[3][gi], self._bt[gi][:hi_rows])
            copy(mirror[4][gi], self._slots[gi][:hi_toks])
        self._dirty_rows, self._dirty_tokens = B, N
        if fixed:
            key = ("device", bcap, ncap)
            views = self._fixed_views.get(key)
            if views is None:
                views = self._fixed_views[key] = self._views(mirror, bcap, ncap)
            return views
        return self._views(mirror, B, N)

    def _host_arrays(self) -> tuple:
        arrays = (self._cum, self._past, self._pos, tuple(self._bt), tuple(self._slots))
        if self.cache.lib.name == "torch":
            torch = self.cache.lib.torch
            arrays = (torch.from_numpy(self._cum), torch.from_numpy(self._past), torch.from_numpy(self._pos),
                      tuple(torch.from_numpy(b) for b in self._bt), tuple(torch.from_numpy(s) for s in self._slots))
        return arrays

    @staticmethod
    def _views(arrays: tuple, rows: int, toks: int) -> tuple:
        cum, past, pos, bts, slots = arrays
        return (cum[:rows + 1], past[:rows], pos[:toks], tuple(b[:rows] for b in bts), tuple(s[:toks] for s in slots))

    def _device_mirror(self) -> tuple:
        if self._mirror is None:
            lib = self.cache.lib
            self._mirror = (lib.from_host(self._cum), lib.from_host(self._past), lib.full(self._pos.shape, -1, "int32"),
                            tuple(lib.full(b.shape, -1, "int32") for b in self._bt),
                            tuple(lib.full(s.shape, -1, "int32") for s in self._slots))
            self._dirty_rows = self._dirty_tokens = 0   # the mirror starts as the padded staging
        return self._mirror

    # -- checks ------------------------------------------------------------------------------------------------
    def check(self) -> None:
        """Assert the manager's invariants (for tests): the pool's own, reference counts equal to the
        mappings of the running sequences, no block in two groups, and every block a sequence will
        write owned by it alone and unregistered."""
        self.pool.check()
        bs = self.block_size
        refs: dict = {}
        owner_group: dict = {}
        R = self.max_num_seqs
        for r, seq in enumerate(self._rows):
            assert seq.row == r and seq.alive and self._ids[r] == seq.id
            length = int(self._computed[r]) + int(self._new[r])
            for g in self.groups:
                gi = g.index
                bt = self._bt[gi][r]
                nm, first = int(self._nmapped[gi][r]), int(self._first[gi][r])
                assert nm >= -(-length // bs), f"row {r} group {gi}: {nm} blocks for {length} tokens"
                assert (bt[nm:] == -1).all() and (bt[:first] == -1).all()
                if self._ring_n[gi]:
                    blocks = [int(b) for b in self._ring[gi][r] if b >= 0]
                    live = bt[first:nm]
                    assert set(int(b) for b in live if b >= 0) <= set(blocks)
                else:
                    blocks = [int(b) for b in bt[first:nm]]
                    assert all(b >= 0 for b in blocks), f"row {r} group {gi}: unmapped live block"
                for b in blocks:
                    refs[b] = refs.get(b, 0) + 1
                    assert owner_group.setdefault(b, gi) == gi, f"block {b} in groups {owner_group[b]} and {gi}"
                # blocks the sequence writes next: private and unregistered
                wf = max(int(self._write_from[gi][r]), int(self._computed[r]))
                for i in range(wf // bs, nm):
                    b = int(bt[i]) if not self._ring_n[gi] else int(self._ring[gi][r][i % self._ring_n[gi]])
                    if b >= 0 and (i + 1) * bs > wf:
                        assert self.pool.ref_count(b) == 1, f"block {b} written by row {r} is shared"
                        assert self.pool.key_of(b) is None or i * bs + bs <= length, f"block {b} written but registered"
        for r in range(len(self._rows), R):
            for bt in self._bt:
                assert (bt[r] == -1).all(), f"row {r} is not running but has blocks"
        for b in range(self.pool.num_blocks):
            assert self.pool.ref_count(b) == refs.get(b, 0), f"block {b}: ref {self.pool.ref_count(b)} != {refs.get(b, 0)}"

    def __repr__(self) -> str:
        return (f"KVCacheManager({self.num_running} running of {self.max_num_seqs}, {self.pool!r}, "
                f"prefix caching {'on' if self.prefix_caching else 'off'})")

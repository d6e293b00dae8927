"""Invariants of the block pool and of the manager's bookkeeping over random operation sequences.

Hypothesis drives random sequences of operations; after every one the invariants are checked: no
block owned twice, reference counts equal to the mappings, nothing leaked once every sequence has
finished, and a capacity error only when the blocks truly are not there (with the state unchanged).
"""

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, settings, strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule  # noqa: E402

import cupa  # noqa: E402
from cupa import serving  # noqa: E402

SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------------- pool

def test_pool_allocates_each_block_once_and_fails_when_empty():
    pool = serving.BlockPool(5)
    got = pool.allocate(3) + [pool.allocate_one(), pool.allocate_one()]
    assert sorted(got) == list(range(5)) and pool.num_free == 0 and pool.num_used == 5
    with pytest.raises(cupa.PagedAttentionError, match=r"blocks: got a request for 1 blocks with 0 free of 5"):
        pool.allocate_one()
    with pytest.raises(cupa.PagedAttentionError):
        pool.allocate(2)
    pool.free([got[0]])
    with pytest.raises(cupa.PagedAttentionError, match="already free"):
        pool.free([got[0]])
    with pytest.raises(cupa.PagedAttentionError, match="2 blocks with 1 free"):
        pool.allocate(2)
    assert pool.num_free == 1       # the failed request took nothing
    pool.check()


def test_pool_prefix_cache_lru_eviction():
    pool = serving.BlockPool(3, namespaces=2)
    a, b, c = pool.allocate(3)
    assert pool.register(a, "ka") and pool.register(b, "kb") and pool.register(c, "kc", namespace=1)
    assert not pool.register(c, "ka")              # c holds a key already
    assert pool.register(a, "ka")                  # same block, same key: stays
    assert pool.lookup("kc") is None and pool.lookup("kc", 1) == c
    pool.free([b, a])                              # b freed first: the least recently used
    pool.free([c])
    assert pool.num_free == 3 and pool.num_cached == 3 and pool.num_used == 0
    assert pool.acquire("ka") == a and pool.ref_count(a) == 1   # a hit revives a cached free block
    first = pool.allocate_one()                    # evicts b (oldest), unregisters it
    assert first == b and pool.lookup("kb") is None and pool.key_of(b) is None
    assert pool.allocate_one() == c and pool.lookup("kc", 1) is None
    pool.check()
    pool.free([a, b, c])
    pool.clear_cache()
    assert pool.num_cached == 0 and pool.num_free == 3
    pool.check()


class PoolMachine(RuleBasedStateMachine):
    """BlockPool against a plain model: owner counts per block and a key table."""

    def __init__(self):
        super().__init__()
        self.pool = serving.BlockPool(12, namespaces=2)
        self.refs = {}          # block -> reference count (model)
        self.keys = {}          # (namespace, key) -> block (model; evicted entries removed lazily)

    @rule(n=st.integers(0, 5))
    def allocate(self, n):
        free = self.pool.num_free
        assert free == 12 - len(self.refs)
        if n > free:
            with pytest.raises(cupa.PagedAttentionError):
                self.pool.allocate(n)
            assert self.pool.num_free == free
            return
        for b in self.pool.allocate(n):
            assert b not in self.refs, f"block {b} handed out twice"
            self.refs[b] = 1
            self.keys = {k: v for k, v in self.keys.items() if v != b}   # an evicted block loses its key

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def share_or_free(self, data):
        b = data.draw(st.sampled_from(sorted(self.refs)))
        if data.draw(st.booleans()):
            self.pool.share(b)
            self.refs[b] += 1
        else:
            self.pool.free([b])
            self.refs[b] -= 1
            if not self.refs[b]:
                del self.refs[b]

    @precondition(lambda self: self.refs)
    @rule(data=st.data(), key=st.integers(0, 6), ns=st.integers(0, 1))
    def register(self, data, key, ns):
        b = data.draw(st.sampled_from(sorted(self.refs)))
        taken = (ns, key) in self.keys or b in self.keys.values()
        ok = self.pool.register(b, key, ns)
        assert ok == (not taken or self.keys.get((ns, key)) == b)
        if not taken:
            self.keys[(ns, key)] = b

    @rule(key=st.integers(0, 6), ns=st.integers(0, 1))
    def acquire(self, key, ns):
        b = self.pool.acquire(key, ns)
        assert b == self.keys.get((ns, key))
        if b is not None:
            self.refs[b] = self.refs.get(b, 0) + 1

    @invariant()
    def consistent(self):
        self.pool.check()
        for b in range(12):
            assert self.pool.ref_count(b) == self.refs.get(b, 0)
        assert self.pool.num_cached == len(self.keys)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = SETTINGS


# ---------------------------------------------------------------------------------------------- manager

BS, W, RING_Q = 4, 6, 3


class ManagerMachine(RuleBasedStateMachine):
    """KVCacheManager operations at random; every invariant after every operation.

    Groups 0 and 1 are full attention and an evicting window; group 2 is a ring window when
    ``RING`` (then prefix hits map blocks of group 0 but resend the tokens) and a second full
    group otherwise (then hits skip the tokens).
    """

    NUM_BLOCKS = 24
    RING = True

    def __init__(self):
        super().__init__()
        third = serving.sliding_window(W, "ring", max_query_len=RING_Q) if self.RING else serving.full_attention()
        kinds = [serving.full_attention(), serving.sliding_window(W, "evict"), third, serving.full_attention()]
        cache = serving.KVCache(kinds, kv_num_heads=1, head_size=8, dtype="float16", block_size=BS,
                                num_blocks=self.NUM_BLOCKS, group_size=1)
        self.m = serving.KVCacheManager(cache, max_num_seqs=5, max_model_len=48, max_num_batched_tokens=24)
        self.ring_n = third.ring_blocks(BS) if self.RING else 0
        self.ring_group = [g.index for g in cache.groups if g.kind.policy == "ring"]
        self.groups = range(len(cache.groups))
        self.ring_peak = {}      # seq -> most logical blocks the ring group ever entered (slots allocated)
        self.tokens = {}         # seq -> tokens (to give prefixes to new sequences)
        self.floor = {}          # seq -> length at its last step (a rollback goes back that far at most)
        self.next_id = 0

    def _need(self, seq, n):
        """Blocks ``append(seq, n tokens)`` must allocate, computed here from public state."""
        m = self.m
        start, last = m.length(seq), (m.length(seq) + n - 1) // BS
        need = 0
        for g in self.groups:
            nm = len(m.block_table(seq, g))
            if g in self.ring_group:
                allocated = min(self.ring_n, self.ring_peak.get(seq, 0))
                need += sum(1 for s in {i % self.ring_n for i in range(nm, last + 1)} if s >= allocated)
            else:
                need += max(0, last + 1 - nm)
        return need

    def _ring_ok(self, seq, n):
        lo = max(0, self.m.num_computed(seq) - W + 1) // BS
        return not self.RING or (self.m.length(seq) + n - 1) // BS - lo + 1 <= self.ring_n

    def _tables(self, seq):
        return [self.m.block_table(seq, g).tolist() for g in self.groups]

    def _peak(self, seq):
        for g in self.ring_group:
            self.ring_peak[seq] = max(self.ring_peak[seq], len(self.m.block_table(seq, g)))

    @precondition(lambda self: self.m.num_running < 5)
    @rule(share=st.sampled_from([True, True, False]), extra=st.integers(0, 9), data=st.data())
    def add(self, share, extra, data):
        seq = self.next_id
        self.next_id += 1
        base = []
        if share and self.tokens:
            other = data.draw(st.sampled_from(sorted(self.tokens)))
            n = len(self.tokens[other])
            base = self.tokens[other][:data.draw(st.integers(n // 2, n))]
        prompt = base + [data.draw(st.integers(0, 3)) for _ in range(extra)]
        cached = self.m.add(seq, prompt)
        assert cached % BS == 0 and cached <= max(0, len(prompt) - 1)
        event("prefix hit" if cached else "no prefix hit")
        if any(self.m.pool.ref_count(b) > 1 for b in range(self.NUM_BLOCKS)):
            event("blocks shared")
        self.tokens[seq] = prompt[:cached]
        self.floor[seq] = cached
        self.ring_peak[seq] = 0

    @precondition(lambda self: self.m.num_running)
    @rule(data=st.data(), n=st.integers(1, RING_Q))
    def append(self, data, n):
        seq = data.draw(st.sampled_from(self.m.seq_ids))
        if self.m.length(seq) + n > 48 or not self._ring_ok(seq, n) or n > self.m.max_new_tokens(seq):
            return
        toks = [data.draw(st.integers(0, 3)) for _ in range(n)]
        need, free = self._need(seq, n), self.m.num_free_blocks
        before = (self.m.length(seq), self._tables(seq))
        if need > free:
            event("append: out of blocks")
            with pytest.raises(cupa.PagedAttentionError, match="blocks"):
                self.m.append(seq, toks)
            assert (self.m.length(seq), self._tables(seq)) == before
            assert self.m.num_free_blocks == free
            return
        self.m.append(seq, toks)       # never fails when the blocks are there
        self.tokens[seq] += toks
        self._peak(seq)

    @precondition(lambda self: self.m.num_running)
    @rule()
    def build(self):
        for s in self.m.seq_ids:
            self.floor[s] = self.m.num_computed(s)
        step = self.m.build_step()
        assert step.batch_size == self.m.num_running
        for g in self.groups:
            bt, slots = step.block_tables[g], step.slot_mappings[g]
            used = slots[slots >= 0] // BS
            assert np.isin(used, bt[bt >= 0]).all(), "a slot outside the sequence's blocks"

    @precondition(lambda self: self.m.num_running)
    @rule(data=st.data())
    def rollback(self, data):
        seq = data.draw(st.sampled_from(self.m.seq_ids))
        most = self.m.length(seq) - self.floor[seq]
        n = data.draw(st.integers(0, most + 1))
        if n > most:
            with pytest.raises(cupa.PagedAttentionError, match="num_tokens"):
                self.m.rollback(seq, n)
            return
        event("rollback past the last step" if self.m.length(seq) - n < self.m.num_computed(seq) else "rollback")
        self.m.rollback(seq, n)
        if n:
            del self.tokens[seq][-n:]

    @precondition(lambda self: self.m.num_running)
    @rule(data=st.data(), preempt=st.booleans())
    def finish(self, data, preempt):
        seq = data.draw(st.sampled_from(self.m.seq_ids))
        if preempt:
            assert self.m.preempt(seq) == len(self.tokens[seq])
        else:
            self.m.finish(seq)
        del self.tokens[seq]

    @precondition(lambda self: 0 < self.m.num_running < 5)
    @rule(data=st.data())
    def fork(self, data):
        seq = data.draw(st.sampled_from(self.m.seq_ids))
        if self.m.length(seq) != self.m.num_computed(seq):
            with pytest.raises(cupa.PagedAttentionError, match="not yet built"):
                self.m.fork(seq, self.next_id)
            return
        try:
            self.m.fork(seq, self.next_id)
        except cupa.PagedAttentionError as e:
            assert "blocks" in str(e)
            event("fork: out of blocks")
            return
        event("fork")
        self.tokens[self.next_id] = list(self.tokens[seq])
        self.floor[self.next_id] = self.m.length(seq)
        self.ring_peak[self.next_id] = self.ring_peak[seq]
        self.next_id += 1

    @invariant()
    def consistent(self):
        self.m.check()
        for s in self.m.seq_ids:
            assert self.m.length(s) == len(self.tokens[s])

    def teardown(self):
        for s in self.m.seq_ids:
            self.m.finish(s)
        self.m.check()
        assert self.m.num_used_blocks == 0, "blocks leaked"
        assert self.m.num_free_blocks == self.NUM_BLOCKS


class ManagerMachineNoRing(ManagerMachine):
    RING = False


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = SETTINGS
TestManagerMachineNoRing = ManagerMachineNoRing.TestCase
TestManagerMachineNoRing.settings = SETTINGS

"""The serving toolkit on the NumPy backend: cache allocation, step inputs, fixed buffers, prefix
sharing, copy-on-write, and a continuous-batching simulation against dense attention at every step."""

import numpy as np
import pytest

import cupa
from cupa import serving
from tests import util
from tests.serving_cases import Driver, ToyModel, to_host

BACKENDS = [pytest.param("numpy", id="numpy"), pytest.param("cupy", marks=pytest.mark.gpu, id="cupy")]


@pytest.fixture(params=BACKENDS)
def xp(request):
    return np if request.param == "numpy" else pytest.importorskip("cupy")


def _manager(kinds=1, *, bs=4, num_blocks=64, seqs=4, model_len=64, tokens=64, prefix=True, **cache_kw):
    cache_kw = {"kv_num_heads": 1, "head_size": 8, "dtype": "float16", **cache_kw}
    cache = serving.KVCache(kinds, block_size=bs, num_blocks=num_blocks, **cache_kw)
    return serving.KVCacheManager(cache, max_num_seqs=seqs, max_model_len=model_len, max_num_batched_tokens=tokens,
                                  enable_prefix_caching=prefix)


# ---------------------------------------------------------------------------------------------- layers, cache

def test_layer_groups_share_one_pool():
    full, win = serving.full_attention(), serving.sliding_window(128)
    groups, slots = serving.group_layers([full, win] * 12)           # GPT-OSS: alternating, 12 + 12
    assert [(g.kind, len(g.layers)) for g in groups] == [(full, 12), (win, 12)]
    assert slots[0] == (0, 0) and slots[1] == (1, 0) and slots[23] == (1, 11)
    gemma = [win] * 5 + [full]
    groups, slots = serving.group_layers(gemma * 4 + [win, win])      # 22 window + 4 full: groups of 4
    assert [len(g.layers) for g in groups] == [4, 4, 4, 4, 4, 2, 4]
    assert {slots[i] for i in range(26)} == {(g.index, j) for g in groups for j in range(len(g.layers))}
    cache = serving.KVCache([full, win] * 2, kv_num_heads=2, head_size=16, num_blocks=10)
    assert len(cache.key_caches) == 2                                 # one tensor per group slot, not per layer
    assert cache.bytes_per_block == 2 * 2 * 4 * 2 * 16 * 2 * 16 // 4  # tensors, K+V, 16 slots, Hk, D, fp16
    assert cache.layer_arrays(0)[0] is cache.layer_arrays(1)[0] is cache.key_caches[0]
    assert cache.attributes(1)["local_window_size"] == 128 and "local_window_size" not in cache.attributes(0)


@pytest.mark.parametrize("bad, match", [
    (dict(window=0), "window"), (dict(window=4, policy="drop"), "policy"), (dict(policy="ring"), "policy"),
    (dict(window=4, policy="ring", max_query_len=0), "max_query_len")])
def test_layer_kind_validation(bad, match):
    with pytest.raises(cupa.PagedAttentionError, match=match):
        serving.LayerKind(**bad)


def test_ring_blocks_rule():
    assert serving.sliding_window(128, "ring").ring_blocks(16) == 9          # ceil(128/16) + 1
    assert serving.sliding_window(5, "ring").ring_blocks(4) == 3
    assert serving.sliding_window(128, "ring", max_query_len=64).ring_blocks(16) == 13


@pytest.mark.parametrize("name", sorted(serving.CACHE_DTYPES))
@pytest.mark.parametrize("layout", ["SEPARATE", "LATENT"])
def test_every_cache_dtype_allocates_and_runs(rng, name, layout):
    """Each table entry allocates its arrays and gives op attributes the op accepts (one real call)."""
    entry = serving.CACHE_DTYPES[name]
    T = name if not entry.quantized else "float32"
    Hk = 1 if layout == "LATENT" else 2
    cache = serving.KVCache([serving.full_attention(), serving.sliding_window(3, "ring")], kv_num_heads=Hk,
                            head_size=16, dtype=T, cache_dtype=name, k_quant_type="PER_CHANNEL",
                            kv_cache_layout=layout, block_size=4, num_blocks=6)
    assert cache.key_caches[0].dtype.name == entry.storage
    assert cache.key_caches[0].shape == (6, 4, Hk, 16 // entry.elements_per_item)
    assert (cache.value_caches[0] is None) == (layout == "LATENT")
    m = serving.KVCacheManager(cache, max_num_seqs=2, max_model_len=16, enable_prefix_caching=False)
    m.add("a")
    m.append("a", 3)
    step = m.build_step()
    for layer in range(2):
        op = cupa.PagedAttention(num_heads=2, **cache.attributes(layer))
        q = util._rand_T(rng, (3, 2 * 16), util.T_DTYPES[T])
        k = util._rand_T(rng, (3, Hk * 16), util.T_DTYPES[T])
        v = None if layout == "LATENT" else util._rand_T(rng, (3, Hk * 16), util.T_DTYPES[T])
        out = step.attention(op, layer, q, k, v)
        assert out.shape == (3, 32) and np.isfinite(out.astype(np.float64)).all()
    assert np.count_nonzero(cache.key_caches[0].view(np.uint8)) > 0      # the op wrote the blocks


@pytest.mark.parametrize("name,zero_byte", [("int4", 0x88), ("float4e2m1", 0x00)])
def test_packed_cache_dtypes_follow_their_table_entry(name, zero_byte):
    """A packed 4-bit type: storage, last dimension, bytes, fill and attributes all follow the entry."""
    cache = serving.KVCache(2, kv_num_heads=2, head_size=64, dtype="float16", cache_dtype=name,
                            k_quant_type="PER_CHANNEL", block_size=16, memory_bytes=10 * 2 * 2 * 16 * 2 * 32)
    assert cache.num_blocks == 10 and cache.key_caches[0].shape == (10, 16, 2, 32)
    assert cache.bytes_per_block == 2 * 2 * 16 * 2 * 32
    assert cache.key_caches[0].dtype == np.uint8
    for c in cache.key_caches + cache.value_caches:   # every code 0.0: an unwritten row reads as zeros
        assert (c == zero_byte).all()
        np.testing.assert_array_equal(cupa.dequantize(c[0], np.ones(1, np.float32), name), 0.0)
    assert cache.k_scales[0].shape == (2, 1, 64) and cache.v_scales[0].shape == (1,)
    assert cache.attributes(0) == dict(kv_num_heads=2, k_quant_type="PER_CHANNEL", k_cache_dtype=name,
                                       v_quant_type="PER_TENSOR", v_cache_dtype=name)
    import ml_dtypes

    assert serving.KVCache(1, kv_num_heads=1, head_size=8, cache_dtype=np.dtype(ml_dtypes.float4_e2m1fn) if
                           name == "float4e2m1" else name, num_blocks=1).cache_dtype.name == name


def test_block_count_from_budget():
    kw = dict(kv_num_heads=8, head_size=128, dtype="bfloat16", block_size=16)
    per_block = 4 * 2 * 16 * 8 * 128 * 2
    assert serving.KVCache(4, memory_bytes=per_block * 7 + 5, **kw).num_blocks == 7
    assert serving.KVCache(4, memory_bytes=100, **kw).num_blocks == 0
    assert serving.KVCache(4, cache_dtype="int8", memory_bytes=per_block * 7, **kw).num_blocks == 14
    with pytest.raises(cupa.PagedAttentionError, match="exactly one"):
        serving.KVCache(4, num_blocks=3, memory_bytes=10, **kw)
    with pytest.raises(cupa.PagedAttentionError, match="memory_fraction: got a NumPy cache"):
        serving.KVCache(4, memory_fraction=0.8, **kw)
    with pytest.raises(cupa.PagedAttentionError, match="cache_dtype"):
        serving.KVCache(4, cache_dtype="float16", num_blocks=1, **kw)       # fp16 cache, bf16 T
    with pytest.raises(cupa.PagedAttentionError, match="kv_num_heads: got 8; expected 1 in LATENT"):
        serving.KVCache(4, kv_cache_layout="LATENT", num_blocks=1, **kw)


def test_torch_cpu_cache_and_step_arrays(rng):
    """PyTorch CPU caches and step arrays: the op runs on them (the reference) like on NumPy ones."""
    torch = pytest.importorskip("torch")
    fp8 = serving.KVCache(2, kv_num_heads=2, head_size=16, dtype="float16", cache_dtype="float8e4m3fn",
                          block_size=4, num_blocks=8, library="torch")
    assert fp8.key_caches[0].dtype == torch.float8_e4m3fn and fp8.k_scales[0].dtype == torch.float32
    assert "k_cache_dtype" not in fp8.attributes(0)
    runs = {}
    for library in ("numpy", "torch"):
        cache = serving.KVCache(2, kv_num_heads=2, head_size=16, dtype="float16", block_size=4, num_blocks=8,
                                library=library)
        m = serving.KVCacheManager(cache, max_num_seqs=2, max_model_len=16, enable_prefix_caching=False)
        m.add(0)
        m.append(0, 5)
        m.add(1)
        m.append(1, 2)
        step = m.build_step()
        runs[library] = (cache, step)
    (ncache, nstep), (tcache, tstep) = runs["numpy"], runs["torch"]
    for name in ("cumulative_sequence_length", "past_seqlens", "query_positions"):
        t = getattr(tstep, name)
        assert isinstance(t, torch.Tensor) and t.dtype == torch.int32
        np.testing.assert_array_equal(t.numpy(), getattr(nstep, name))
    np.testing.assert_array_equal(tstep.block_tables[0].numpy(), nstep.block_tables[0])
    np.testing.assert_array_equal(tstep.slot_mappings[0].numpy(), nstep.slot_mappings[0])
    op = cupa.PagedAttention(num_heads=2, **tcache.attributes(0))
    q, kv = util._rand_T(rng, (7, 32), np.float16), util._rand_T(rng, (7, 32), np.float16)
    out_t = tstep.attention(op, 0, torch.from_numpy(q), torch.from_numpy(kv), torch.from_numpy(kv))
    out_n = nstep.attention(op, 0, q, kv, kv)
    assert isinstance(out_t, torch.Tensor)
    np.testing.assert_array_equal(out_t.numpy(), out_n)
    np.testing.assert_array_equal(tcache.key_caches[0].numpy(), ncache.key_caches[0])
    b = int(tstep.block_tables[0][0, 1])
    tcache.copy_blocks([b], [7])                                          # torch's own indexing
    assert torch.equal(tcache.key_caches[0][7], tcache.key_caches[0][b])
    fp8.key_caches[0][2] = torch.full((4, 2, 16), 3.0).to(torch.float8_e4m3fn)
    fp8.copy_blocks([2], [5])
    assert torch.equal(fp8.key_caches[0][5].view(torch.uint8), fp8.key_caches[0][2].view(torch.uint8))


# ---------------------------------------------------------------------------------------------- step inputs

def test_step_inputs_by_hand():
    """Two prompts, then decode: every array of the step against values written out here."""
    m = _manager(bs=4, prefix=False)
    m.add("a")
    m.add("b")
    m.append("a", 6)
    m.append("b", 3)
    s = m.build_step()
    bt_a, bt_b = m.block_table("a"), m.block_table("b")
    assert s.seq_ids == ["a", "b"] and (s.batch_size, s.token_count) == (2, 9)
    np.testing.assert_array_equal(s.cumulative_sequence_length, [0, 6, 9])
    np.testing.assert_array_equal(s.past_seqlens, [0, 0])
    np.testing.assert_array_equal(s.query_positions, [0, 1, 2, 3, 4, 5, 0, 1, 2])
    slots = [bt_a[p // 4] * 4 + p % 4 for p in range(6)] + [bt_b[0] * 4 + p for p in range(3)]
    np.testing.assert_array_equal(s.slot_mappings[0], slots)
    assert s.block_tables[0].shape == (2, 16) and list(s.block_tables[0][0, :2]) == list(bt_a)
    assert (s.block_tables[0][0, 2:] == -1).all() and (s.block_tables[0][1, 1:] == -1).all()
    np.testing.assert_array_equal(s.attention_metadata, [6, 6])
    np.testing.assert_array_equal(s.logits_indices, [5, 8])
    np.testing.assert_array_equal(s.seq_lens, [6, 3])
    m.append_decode(None)
    m.append("b", 2)                                  # b: a decode token and 2 more (a draft-like step)
    s = m.build_step()
    np.testing.assert_array_equal(s.cumulative_sequence_length, [0, 1, 4])
    np.testing.assert_array_equal(s.past_seqlens, [6, 3])
    np.testing.assert_array_equal(s.query_positions, [6, 3, 4, 5])
    bt_b = m.block_table("b")
    np.testing.assert_array_equal(s.slot_mappings[0], [bt_a[1] * 4 + 2, bt_b[0] * 4 + 3, bt_b[1] * 4, bt_b[1] * 4 + 1])
    np.testing.assert_array_equal(s.attention_metadata, [3, 7])
    m.finish("a")                                     # b moves to row 0
    s = m.build_step()
    assert s.seq_ids == ["b"] and s.token_count == 0 and s.logits_indices.tolist() == [-1]
    assert m.num_used_blocks == 2


def test_window_groups_block_tables():
    """Ring: ceil(W/bs)+1 blocks recycled, entries below the window -1; evict: the same entries,
    blocks back in the pool (seed 9.3.2: below max(0, past - W + 1) // bs)."""
    W, bs = 6, 4
    m = _manager([serving.sliding_window(W, "ring"), serving.sliding_window(W, "evict")], bs=bs,
                 prefix=False, model_len=128)
    m.add("a")
    m.append("a", 5)
    m.build_step()
    ring_blocks = set()
    for _ in range(40):
        m.append_decode(None)
        s = m.build_step()
        past = int(s.past_seqlens[0])
        first = max(0, past - W + 1) // bs
        for g in (0, 1):
            row = np.asarray(s.block_tables[g][0])
            assert (row[:first] == -1).all() and (row[first:past // bs + 1] >= 0).all()
            assert (row[past // bs + 1:] == -1).all()
            slot = int(s.slot_mappings[g][0])
            assert slot == row[past // bs] * bs + past % bs
        ring_blocks |= set(m.block_table("a", 0)[m.block_table("a", 0) >= 0].tolist())
    assert len(ring_blocks) == serving.sliding_window(W, "ring").ring_blocks(bs) == 3
    live = -(-(W + bs) // bs)
    assert m.num_used_blocks <= 3 + live                                   # O(W), not O(length)


def test_validation_errors():
    m = _manager([serving.full_attention(), serving.sliding_window(6, "ring")], bs=4, num_blocks=8, seqs=2,
                 model_len=20, tokens=12, prefix=True)
    m.add("a", [1, 2, 3])
    with pytest.raises(cupa.PagedAttentionError, match="seq_id: got 'a'; expected a name not used"):
        m.add("a")
    with pytest.raises(cupa.PagedAttentionError, match="seq_id: got 'zz'; expected a running sequence"):
        m.append("zz", [1])
    with pytest.raises(cupa.PagedAttentionError, match="tokens: got a token count; expected token ids"):
        m.append("a", 3)
    with pytest.raises(cupa.PagedAttentionError, match="max_num_batched_tokens=12"):
        m.append("a", list(range(13)))
    m.append("a", list(range(8)))
    m.build_step()
    with pytest.raises(cupa.PagedAttentionError, match="tokens: got 5 tokens at position 8 of a ring.*at most 4"):
        m.append("a", list(range(5)))                                      # the ring holds 3 blocks
    assert m.max_new_tokens("a") == 4
    m.add("b")
    with pytest.raises(cupa.PagedAttentionError, match="fewer than max_num_seqs=2"):
        m.add("c")
    with pytest.raises(cupa.PagedAttentionError, match="blocks: got a request for 6 blocks with 4 free of 8"):
        m.append("b", list(range(9)))                                     # 3 blocks in each group
    assert m.length("b") == 0 and m.num_free_blocks == 4                   # nothing taken
    m.append("a", [1, 2])
    m.append("b", [1])
    with pytest.raises(cupa.PagedAttentionError, match="fixed=True"):
        m.build_step(batch_size=4)
    with pytest.raises(cupa.PagedAttentionError, match="at most batch_size=1 sequences and token_count=12"):
        m.build_step(fixed=True, batch_size=1)
    with pytest.raises(cupa.PagedAttentionError, match="a sequence with 2 new tokens; expected at most max_query_len=1"):
        m.build_step(fixed=True, max_query_len=1)
    m.build_step()
    with pytest.raises(cupa.PagedAttentionError, match="num_tokens: got 3; expected at most 2"):
        m.rollback("a", 3)
    with pytest.raises(cupa.PagedAttentionError, match="max_model_len=20"):
        m.append("a", list(range(11)))
    m.check()


# ---------------------------------------------------------------------------------------------- fixed buffers

def _pointer(x):
    return x.__array_interface__["data"][0]


def test_fixed_capacity_buffers_are_the_same_arrays_and_padded(rng):
    """build_step(fixed=True): one set of arrays for every step, padded rows and -1 entries, and a
    replay-wide attention_metadata; the outputs of the live tokens match dense attention."""
    H = 2
    model = ToyModel(rng, 2, H, 1, 8, "float32")
    d = Driver(rng, model, H, dict(layers=[serving.full_attention(), serving.sliding_window(5, "ring")],
                                   kv_num_heads=1, head_size=8, dtype="float32", block_size=4, num_blocks=40),
               dict(max_num_seqs=4, max_model_len=40, max_num_batched_tokens=16))
    first = None
    plan = [{"a": 3, "b": 2}, {"a": 1, "b": 1}, {"a": 1, "c": 4}, {"b": 1, "c": 1}, {"c": 1}]
    for i, counts in enumerate(plan):
        for s, n in counts.items():
            if s not in d.m:
                d.add(s, [])
            d.append(s, rng.integers(0, 90, n))
        if i == 3:
            d.finish("a")
        step, _, outs = d.step(fixed=True, batch_size=3, token_count=8, max_query_len=4)
        arrays = (step.cumulative_sequence_length, step.past_seqlens, step.query_positions,
                  *step.block_tables, *step.slot_mappings, step.attention_metadata)
        if first is None:
            first = arrays
        assert all(a is b and _pointer(a) == _pointer(b) for a, b in zip(arrays, first))
        B, N = step.batch_size, step.token_count
        assert step.cumulative_sequence_length.shape == (4,) and step.query_positions.shape == (8,)
        assert all(bt.shape == (3, 10) for bt in step.block_tables)
        cum = step.cumulative_sequence_length
        assert (cum[B:] == N).all() and (step.past_seqlens[B:] == 0).all()
        assert (step.query_positions[N:] == -1).all()
        for bt, sl in zip(step.block_tables, step.slot_mappings):
            assert (bt[B:] == -1).all() and (sl[N:] == -1).all() and (sl[:N] >= 0).all()
        assert step.attention_metadata.tolist() == [4, 40]
        for out in outs:
            assert (out[N:] == 0).all()                                    # padded tokens output zeros
        d.check_dense(step, [o[:N] for o in outs])


# ---------------------------------------------------------------------------------------------- prefix sharing

def test_prefix_hit_maps_blocks_and_skips_tokens(rng):
    H = 2
    model = ToyModel(rng, 2, H, 1, 8, "float32")
    d = Driver(rng, model, H, dict(layers=[serving.full_attention(), serving.sliding_window(6, "evict")],
                                   kv_num_heads=1, head_size=8, dtype="float32", block_size=4, num_blocks=40),
               dict(max_num_seqs=4, max_model_len=64))
    system = rng.integers(0, 90, 13).tolist()
    cached, rest = d.add("a", system + [1, 2])
    assert cached == 0
    d.append("a", rest)
    d.step()
    used = d.m.num_used_blocks
    cached, rest = d.add("b", system + [5, 6, 7])
    assert cached == 12 and len(rest) == 4                   # three full blocks of the system prompt
    assert list(d.m.block_table("b", 0)[:3]) == list(d.m.block_table("a", 0)[:3])
    bt_evict = d.m.block_table("b", 1)
    assert bt_evict[0] == -1 and list(bt_evict[1:3]) == list(d.m.block_table("a", 1)[1:3])  # window: 7..11
    assert d.m.num_used_blocks == used                       # nothing allocated for the hit
    d.append("b", rest)
    step, _, outs = d.step()
    d.check_dense(step, outs)
    # b's own block 3 in both groups; a's window moved past its block 0 (cached free now)
    assert d.m.num_used_blocks == used + 2 - 1 and d.m.block_table("a", 1)[0] == -1
    d.finish("a")
    d.finish("b")
    assert d.m.num_used_blocks == 0
    cached, _ = d.add("c", system + [9])                       # the cached free blocks are hit again
    assert cached == 12
    cached, _ = d.add("d", system + [9], cache_salt="other tenant")
    assert cached == 0
    d.m.check()


def test_prefix_hit_with_a_ring_group_resends_tokens_but_shares_blocks(rng):
    """A ring group cannot share: the tokens are sent again, the full group maps the cached blocks
    and writes nothing for them (slot -1)."""
    H = 2
    model = ToyModel(rng, 2, H, 1, 8, "float32")
    d = Driver(rng, model, H, dict(layers=[serving.full_attention(), serving.sliding_window(6, "ring", 16)],
                                   kv_num_heads=1, head_size=8, dtype="float32", block_size=4, num_blocks=40),
               dict(max_num_seqs=4, max_model_len=64))
    system = rng.integers(0, 90, 10).tolist()
    d.append("a", d.add("a", system)[1])
    d.step()
    cached, rest = d.add("b", system + [3, 4])
    assert cached == 0 and len(rest) == 12
    assert list(d.m.block_table("b", 0)) == list(d.m.block_table("a", 0)[:2])
    d.append("b", rest)
    step, _, outs = d.step()
    b = step.seq_ids.index("b")
    lo = int(step.cumulative_sequence_length[b])
    full = cache_group = d.cache.group_of(0)
    assert (step.slot_mappings[full][lo:lo + 8] == -1).all() and (step.slot_mappings[full][lo + 8:lo + 12] >= 0).all()
    assert (step.slot_mappings[d.cache.group_of(1)][lo:lo + 12] >= 0).all()
    assert cache_group == 0
    d.check_dense(step, outs)
    d.m.check()


# ---------------------------------------------------------------------------------------------- fork / COW

class _CopySpy:
    """Wraps the cache library's block copy to record what was copied."""

    def __init__(self, lib):
        self.lib, self.calls = lib, []
        self._copy = lib.copy_blocks

    def __call__(self, cache, src, dst):
        self.calls.append((list(src), list(dst)))
        self._copy(cache, src, dst)


def test_fork_copies_the_partial_block_by_device_copy(rng, monkeypatch, xp):
    H = 2
    model = ToyModel(rng, 1, H, 1, 8, "float32")
    cache_kw = dict(layers=1, kv_num_heads=1, head_size=8, dtype="float32", block_size=4, num_blocks=20)
    d = Driver(rng, model, H, cache_kw, dict(max_num_seqs=4, max_model_len=40), xp=xp)
    spy = _CopySpy(d.cache.lib)
    monkeypatch.setattr(d.cache.lib, "copy_blocks", spy)
    d.append("p", d.add("p", rng.integers(0, 90, 10))[1])
    d.step()
    parent_blocks = d.m.block_table("p").tolist()
    d.m.fork("p", "c")
    d.tokens["c"], d.sent["c"] = list(d.tokens["p"]), []
    child_blocks = d.m.block_table("c").tolist()
    assert child_blocks[:2] == parent_blocks[:2] and child_blocks[2] != parent_blocks[2]
    assert spy.calls == [([parent_blocks[2]], [child_blocks[2]])] * 2          # key and value cache
    for c in (to_host(d.cache.key_caches[0]), to_host(d.cache.value_caches[0])):
        assert np.array_equal(c[child_blocks[2]][:2], c[parent_blocks[2]][:2])   # the 2 written slots
    assert d.m.pool.ref_count(parent_blocks[0]) == 2 and d.m.pool.ref_count(child_blocks[2]) == 1
    for _ in range(7):                     # both continue with different tokens
        d.append_decode()
        step, _, outs = d.step()
        d.check_dense(step, outs)
        d.m.check()
    d.finish("p")
    assert d.m.pool.ref_count(parent_blocks[0]) == 1
    d.finish("c")
    assert d.m.num_used_blocks == 0


def test_rollback_into_a_shared_block_copies_it_first(rng, monkeypatch):
    """A block filled by drafts, registered and mapped by another sequence, then reopened by a
    rollback: the rolled-back sequence gets a device copy, the other keeps the original."""
    H = 2
    model = ToyModel(rng, 1, H, 1, 8, "float32")
    d = Driver(rng, model, H, dict(layers=1, kv_num_heads=1, head_size=8, dtype="float32", block_size=4,
                                   num_blocks=20), dict(max_num_seqs=4, max_model_len=40))
    spy = _CopySpy(d.cache.lib)
    monkeypatch.setattr(d.cache.lib, "copy_blocks", spy)
    d.append("a", d.add("a", rng.integers(0, 90, 8))[1])
    d.step()
    d.append("a", rng.integers(0, 90, 4))                 # drafts fill block 2
    d.step()
    shared = int(d.m.block_table("a")[2])
    cached, rest = d.add("b", d.tokens["a"] + [5])
    assert cached == 12 and d.m.pool.ref_count(shared) == 2
    d.rollback("a", 2)
    own = int(d.m.block_table("a")[2])
    assert own != shared and spy.calls == [([shared], [own])] * 2
    assert d.m.pool.ref_count(shared) == 1 and d.m.pool.ref_count(own) == 1
    assert d.m.pool.key_of(own) is None and d.m.pool.key_of(shared) is not None
    d.append("a", rng.integers(0, 90, 1))
    d.append("b", rest)
    for _ in range(4):
        step, _, outs = d.step()
        d.check_dense(step, outs)
        d.m.check()
        d.append_decode()


def test_preempted_sequence_resumes_from_its_cached_blocks(rng):
    H = 2
    model = ToyModel(rng, 1, H, 1, 8, "float32")
    d = Driver(rng, model, H, dict(layers=1, kv_num_heads=1, head_size=8, dtype="float32", block_size=4,
                                   num_blocks=20), dict(max_num_seqs=4, max_model_len=40))
    d.append("a", d.add("a", rng.integers(0, 90, 10))[1])
    d.step()
    for _ in range(3):
        d.append_decode()
        d.step()
    tokens = d.preempt("a")                              # 13 tokens: 3 full blocks registered
    assert len(tokens) == 13 and d.m.num_used_blocks == 0 and d.m.pool.num_cached == 3
    cached, rest = d.add("a", tokens)
    assert cached == 12 and rest == tokens[12:]
    d.append("a", rest)
    step, _, outs = d.step()
    d.check_dense(step, outs)


# ---------------------------------------------------------------------------------------------- simulation

SIM_LAYERS = {
    "full+ring+evict": [serving.full_attention(), serving.sliding_window(10, "ring", max_query_len=6),
                        serving.sliding_window(7, "evict")],
    "full+evict, int8": [serving.full_attention(), serving.sliding_window(9, "evict")],
    "full+ring, int4": [serving.full_attention(), serving.sliding_window(10, "ring", max_query_len=6)],
}
#: a config's cache dtype and the magnitude of its scales (about 4 / the largest code)
SIM_CACHES = {"int8": 0.03, "int4": 0.5}


@pytest.mark.parametrize("config", sorted(SIM_LAYERS))
def test_continuous_batching_matches_dense_attention(rng, config):
    """Requests arrive, prefill in chunks beside decoding ones, share system prompts, are preempted
    when blocks run out and resumed, finish; every output of every step of every layer is checked
    against dense attention over the sequence's full history."""
    H, D = 4, 8
    kinds = SIM_LAYERS[config]
    cache_dtype = next((name for name in SIM_CACHES if name in config), None)
    s = SIM_CACHES.get(cache_dtype)
    scales = (lambda l: (np.float32(rng.uniform(s * 2 / 3, s * 4 / 3, (2, 1, D))), np.float32([s]))) if s else None
    model = ToyModel(rng, len(kinds), H, 2, D, "float32")
    d = Driver(rng, model, H, dict(layers=kinds, kv_num_heads=2, head_size=D, dtype="float32", block_size=4,
                                   num_blocks=34, cache_dtype=cache_dtype, k_quant_type="PER_CHANNEL"),
               dict(max_num_seqs=4, max_model_len=60, max_num_batched_tokens=12), scales=scales)
    systems = [rng.integers(0, 90, 9).tolist(), rng.integers(0, 90, 14).tolist()]
    arrivals = []                 # (step, seq, prompt, final length)
    for i in range(10):
        prompt = systems[i % 2] + rng.integers(0, 90, int(rng.integers(1, 12))).tolist()
        arrivals.append((2 * i, f"r{i}", prompt, len(prompt) + int(rng.integers(3, 14))))
    queue, todo, target = [], {}, {}
    hits = preempted = steps = 0
    while arrivals or queue or d.m.num_running:
        while arrivals and arrivals[0][0] <= steps:
            queue.append(arrivals.pop(0)[1:])
        while queue and d.m.num_running < 4 and d.m.num_free_blocks >= 12:   # admission watermark
            seq, prompt, final = queue.pop(0)
            cached, todo[seq] = d.add(seq, prompt)
            target[seq] = final
            hits += cached > 0 or len(d.m.block_table(seq, 0)) > 0         # a ring group: blocks shared, tokens resent
        if steps == 8:                                     # one preemption by choice, more when blocks run out
            victim = d.m.seq_ids[0]
            queue.insert(0, (victim, d.preempt(victim) + todo.pop(victim), target.pop(victim)))
            preempted += 1
        budget = 12                                        # max_num_batched_tokens
        for s in d.m.seq_ids:
            n = min(6, d.m.max_new_tokens(s), budget) if todo[s] else min(1, budget)
            if n <= 0:
                continue
            tokens = todo[s][:n] if todo[s] else rng.integers(0, 90, 1).tolist()
            try:
                d.append(s, tokens)
            except cupa.PagedAttentionError as e:          # out of blocks: preempt the newest, resume it later
                assert "blocks" in str(e)
                victim = d.m.seq_ids[-1]
                queue.insert(0, (victim, d.preempt(victim) + todo.pop(victim), target.pop(victim)))
                preempted += 1
                break
            todo[s] = todo[s][len(tokens):]
            budget -= len(tokens)
        step, _, outs = d.step()
        steps += 1
        d.check_dense(step, outs, tol=2e-5 if cache_dtype else 1e-5)
        d.m.check()
        for s in step.seq_ids:
            if s in todo and not todo[s] and len(d.tokens[s]) >= target[s]:
                d.finish(s)
                del todo[s], target[s]
        assert steps < 500, "the simulation does not progress"
    assert d.m.num_used_blocks == 0 and d.m.num_running == 0
    assert hits >= 2 and steps > 20, (hits, steps)
    assert preempted >= 1


# ---------------------------------------------------------------------------------------------- CUDA graphs

@pytest.mark.gpu
def test_capture_graph_replays_decode_steps_from_fixed_buffers(rng):
    """A decode step of two layers (full attention and a ring window) captured once with
    cupa.capture_graph over build_step(fixed=True) buffers, replayed while the sequences grow, the
    ring recycles its blocks and one sequence finishes (its row becomes padding)."""
    cp = pytest.importorskip("cupy")
    import cupa

    H, D, B = 8, 64, 4
    model = ToyModel(rng, 2, H, 2, D, "float16")
    kinds = [serving.full_attention(), serving.sliding_window(24, "ring")]
    d = Driver(rng, model, H, dict(layers=kinds, kv_num_heads=2, head_size=D, dtype="float16", block_size=16,
                                   num_blocks=64),
               dict(max_num_seqs=B, max_model_len=128, max_num_batched_tokens=128), xp=cp)
    for s, n in enumerate((20, 3, 9, 30)):
        d.append(s, d.add(s, rng.integers(0, 90, n))[1])
    step, _, outs = d.step()
    d.check_dense(step, outs, tol=2e-3)
    bufs = [[cp.zeros((B, w * D), cp.float16) for w in (H, 2, 2)] for _ in kinds]
    holder = {}

    def decode():
        d.append_decode()
        for s in d.sent:
            d.sent[s] = []
        step = d.m.build_step(fixed=True, batch_size=B, token_count=B, max_query_len=1)
        pos = np.zeros(B, np.int64)
        tok = np.zeros(B, np.int64)
        for b, s in enumerate(step.seq_ids):
            pos[b], tok[b] = len(d.tokens[s]) - 1, d.tokens[s][-1]
        for layer in range(2):
            for buf, x in zip(bufs[layer], model.qkv(layer, tok, pos)):
                buf.set(x)                                       # in place: the graph reads these buffers
        holder["step"] = step
        return step

    def run_layers():
        step = holder["step"]
        return [step.attention(d.ops[l], l, *bufs[l]) for l in range(2)]

    step = decode()
    graph = cupa.capture_graph(run_layers)                        # warm-up runs the first step eagerly
    for i in range(40):
        if i:
            assert decode().block_tables[1] is step.block_tables[1]
        graph.replay()                                            # the first replay redoes the warm-up step
        cp.cuda.get_current_stream().synchronize()
        outs = [cp.asnumpy(o)[:step.batch_size] for o in graph.outputs]
        d.check_dense(holder["step"], outs, tol=2e-3)
        if i == 20:
            d.finish(1)
    graph.close()


# ---------------------------------------------------------------------------------------------- GPU libraries

@pytest.mark.gpu
def test_cupy_cache_from_free_memory_and_fp8_bytes():
    cp = pytest.importorskip("cupy")
    free, _ = cp.cuda.runtime.memGetInfo()
    cache = serving.KVCache(4, kv_num_heads=8, head_size=128, dtype="float16", cache_dtype="float8e4m3fn",
                            block_size=16, memory_fraction=0.02, library="cupy")
    assert 0 < cache.nbytes <= 0.02 * free and cache.num_blocks == int(0.02 * free) // cache.bytes_per_block
    assert cache.key_caches[0].dtype == cp.uint8 and cache.attributes(0)["k_cache_dtype"] == "float8e4m3fn"
    assert isinstance(cache.k_scales[0], cp.ndarray)


@pytest.mark.gpu
def test_torch_cuda_steps_match_the_numpy_reference(rng):
    """The same steps with torch CUDA caches and step arrays (the CUDA backends) and with NumPy ones
    (the reference): SPEC section 6 tolerance at every step, every layer."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    H, D = 8, 64
    model = ToyModel(rng, 2, H, 2, D, "float16")
    kinds = [serving.full_attention(), serving.sliding_window(20, "evict")]
    runs = {}
    for library in ("numpy", "torch"):
        cache = serving.KVCache(kinds, kv_num_heads=2, head_size=D, dtype="float16", block_size=16, num_blocks=64,
                                library=library, device="cuda" if library == "torch" else None)
        runs[library] = (cache, serving.KVCacheManager(cache, max_num_seqs=4, max_model_len=128),
                         [cupa.PagedAttention(num_heads=H, **cache.attributes(l)) for l in range(2)])
    lengths = {0: 30, 1: 5, 2: 17}
    tokens = {s: rng.integers(0, 90, n).tolist() for s, n in lengths.items()}
    for s in tokens:
        for _, m, _ in runs.values():
            m.add(s)
            m.append(s, tokens[s])
    for i in range(12):
        outs = {}
        for library, (cache, m, ops) in runs.items():
            step = m.build_step()
            pos = to_host(step.query_positions).astype(np.int64)
            packed = np.concatenate([np.asarray(tokens[s][len(tokens[s]) - int(n):], np.int64)
                                     for s, n in zip(step.seq_ids, step.query_lens)])
            put = (lambda a: torch.from_numpy(a).cuda()) if library == "torch" else (lambda a: a)
            outs[library] = [to_host(step.attention(ops[l], l, *(put(x) for x in model.qkv(l, packed, pos))))
                             for l in range(2)]
        for layer in range(2):
            util.assert_rel(outs["torch"][layer], outs["numpy"][layer], "float16", what=f"step {i} layer {layer}")
        new = rng.integers(0, 90, 3).tolist()
        for s, t in zip(sorted(tokens), new):
            tokens[s].append(t)
        for _, m, _ in runs.values():
            m.append_decode(new)


def test_benchmark_cases_run():
    """The host benchmark hook of ``python -m cupa.bench`` (suite serving), at its smallest size."""
    cases = serving.benchmark_cases("smoke")
    assert [name for name, _, _ in cases][-1] == "pool: allocate_one + free"
    for name, fn, params in cases:
        for _ in range(3):
            fn()
        assert isinstance(params, dict)

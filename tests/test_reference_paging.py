"""Paging identities of seed sections 17.2 and 9.3.5, on the NumPy reference.

Each identity compares two reference runs that must agree bit for bit: explicit vs derived slots,
-1 slots vs a pre-populated cache, shuffled/shared vs plain block tables, the rolling ring-buffer
window cache vs the full cache at every decode step, attention_metadata absent/tight/loose.
"""

import math

import numpy as np
import pytest

import cupa
from tests import util


def _out(result):
    return result[0] if isinstance(result, tuple) else result


def _same_bits(a, b, what="output"):
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, what
    assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"{what}: not bit-identical"


FEATURES = [
    dict(),
    dict(rotary="half", cache="int8", k_quant="PER_CHANNEL"),
    dict(rotary="interleaved", qk_norm=True, sink=True, cache="fp8_bytes"),
    dict(window=5, softcap=4.0, dtype="bfloat16"),
]


# ---------------------------------------------------------------------------------------------- slots

@pytest.mark.parametrize("opts", FEATURES)
def test_explicit_slots_equal_derived(rng, opts):
    case = util.make_case(rng, q_lens=(4, 0, 7, 1), past=(9, 3, 0, 30), **opts)
    explicit = case.copy()
    pos = case.info["positions"]
    slots = util.derived_slots(case.inputs, case.info["block_size"], positions=pos)
    explicit.inputs["slot_mapping"] = slots.astype(np.int32)
    assert (explicit.inputs["slot_mapping"] >= 0).all()
    r1, r2 = case.run(), explicit.run()
    _same_bits(r1, r2)
    _same_bits(case.inputs["key_cache"], explicit.inputs["key_cache"], "key_cache")
    _same_bits(case.inputs["value_cache"], explicit.inputs["value_cache"], "value_cache")


@pytest.mark.parametrize("opts", FEATURES)
def test_skipped_slots_leave_cache_and_match_prepopulated(rng, opts):
    """Prefix-cache simulation: the first tokens of each prefill are already cached (slot -1)."""
    case = util.make_case(rng, q_lens=(6, 3, 5), past=(0, 12, 2), **opts)
    N = case.token_count
    skip = np.zeros(N, dtype=bool)
    skip[[0, 1, 2, 6, 9, 10]] = True            # leading tokens of seq0 and seq2, first of seq1
    slots = util.derived_slots(case.inputs, 16, positions=case.info["positions"])

    full = case.copy()
    r_full = full.run()                         # writes every token

    # (a) -1 slots on the original cache: skipped slots keep their bytes
    a = case.copy()
    a.inputs["slot_mapping"] = np.where(skip, -1, slots).astype(np.int32)
    a.run()
    for name in ("key_cache", "value_cache"):
        fl = lambda c: c.inputs[name].reshape(-1, *c.inputs[name].shape[2:])
        _same_bits(fl(a)[slots[skip]], fl(case)[slots[skip]], name + " (skipped rows)")
        _same_bits(fl(a)[slots[~skip]], fl(full)[slots[~skip]], name + " (written rows)")

    # (b) pre-populate the skipped rows with what the full run wrote: identical result
    b = case.copy()
    for name in ("key_cache", "value_cache"):
        fl_b = b.inputs[name].reshape(-1, *b.inputs[name].shape[2:])
        fl_f = full.inputs[name].reshape(-1, *full.inputs[name].shape[2:])
        fl_b[slots[skip]] = fl_f[slots[skip]]
    b.inputs["slot_mapping"] = np.where(skip, -1, slots).astype(np.int32)
    r_b = b.run()
    _same_bits(r_b, r_full)
    _same_bits(b.inputs["key_cache"], full.inputs["key_cache"], "key_cache")
    _same_bits(b.inputs["value_cache"], full.inputs["value_cache"], "value_cache")


def test_all_slots_skipped_cache_byte_identical(rng):
    case = util.make_case(rng, cache="fp8", q_lens=(3, 5), past=(4, 0))
    before = case.copy()
    case.inputs["slot_mapping"] = np.full(case.token_count, -1, np.int32)
    case.run()
    _same_bits(case.inputs["key_cache"], before.inputs["key_cache"], "key_cache")
    _same_bits(case.inputs["value_cache"], before.inputs["value_cache"], "value_cache")


# ---------------------------------------------------------------------------------------------- tables

def _relayout(case, rng, NB_new):
    """The same logical cache under a different physical block assignment."""
    new = case.copy()
    bt = case.inputs["block_table"]
    perm = rng.permutation(NB_new)
    mapping = {}
    new_bt = np.full_like(bt, -1)
    for (b, i), blk in np.ndenumerate(bt):
        if blk >= 0:
            mapping.setdefault(int(blk), int(perm[len(mapping)]))
            new_bt[b, i] = mapping[int(blk)]
    for name in ("key_cache", "value_cache"):
        old = case.inputs[name]
        c = util._random_cache(rng, (NB_new,) + old.shape[1:], case.info["cache"], old.dtype, 100)
        c = c.view(old.dtype) if c.dtype != old.dtype else c
        for o, n in mapping.items():
            c[n] = old[o]
        new.inputs[name] = c
    new.inputs["block_table"] = new_bt
    return new, mapping


@pytest.mark.parametrize("opts", FEATURES[:3])
def test_shuffled_tables_give_identical_results(rng, opts):
    case = util.make_case(rng, q_lens=(3, 1, 6), past=(20, 40, 5), shuffle=False, unused_cols="neg", **opts)
    other, mapping = _relayout(case, rng, case.inputs["key_cache"].shape[0] + 5)
    r1, r2 = case.run(), other.run()
    _same_bits(r1, r2)
    for name in ("key_cache", "value_cache"):
        for o, n in mapping.items():
            _same_bits(case.inputs[name][o], other.inputs[name][n], name)


def test_shared_prefix_blocks(rng):
    """Two sequences sharing their prefix blocks equal the same run with private copies."""
    bs = 8
    prefix = 3 * bs
    case = util.make_case(rng, q_lens=(2, 3), past=(prefix + 5, prefix + 1), block_size=bs, rotary="half",
                          shuffle=False, unused_cols="neg")
    bt = case.inputs["block_table"]
    private = case.copy()
    # private: seq1's prefix blocks are copies of seq0's; shared: seq1 points at seq0's blocks
    for name in ("key_cache", "value_cache"):
        private.inputs[name][bt[1, :3]] = private.inputs[name][bt[0, :3]]
    shared = private.copy()
    shared.inputs["block_table"][1, :3] = bt[0, :3]
    dense = util.dense_attention(shared)
    r_priv, r_shared = private.run(), shared.run()
    _same_bits(r_priv, r_shared)
    util.check_against_dense(shared, r_shared, dense)


def test_unmapped_blocks_are_masked(rng):
    """A -1 block entry masks its positions: the garbage in any block never matters."""
    case = util.make_case(rng, q_lens=(2, 3), past=(30, 17), block_size=8, qk_output=1, sink=True)
    case.inputs["block_table"][0, 1] = -1
    case.inputs["block_table"][1, 0] = -1
    dense = util.dense_attention(case)
    other = case.copy()
    # change every block that is not referenced by the table: no effect
    referenced = set(case.inputs["block_table"][case.inputs["block_table"] >= 0].tolist())
    NB = case.inputs["key_cache"].shape[0]
    for name in ("key_cache", "value_cache"):
        for blk in set(range(NB)) - referenced:
            other.inputs[name][blk] = -other.inputs[name][blk]
    r1, r2 = case.run(), other.run()
    util.check_against_dense(case, r1, dense)
    _same_bits(r1[0], r2[0])
    assert np.all(r1[1][:, 0:2, 8:16] == 0) and np.all(r1[1][:, 2:5, 0:8] == 0)


@pytest.mark.parametrize("table", ["shuffled", "unmapped"])
@pytest.mark.parametrize("opts", [dict(), dict(window=33, sink=True), dict(is_causal=0, softcap=20.0)])
def test_nan_in_rows_no_sequence_reads_never_reaches_the_output(rng, table, opts):
    """NaN in every cache row no sequence reads (past each sequence's keys, unmapped and spare blocks) leaves
    the output bit-identical: masked keys are zeroed, not multiplied by their zero probability."""
    from tests import util

    for block_size in (1, 8, 24, 64):
        inputs, attrs = util.build(rng, q_lens=[30, 0, 45, 1], past=[40, 5, 130, 77], H=4, Hk=2, D=32,
                                 block_size=block_size, block_table=table, **opts)
        clean = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in inputs.items()}
        assert util.poison_unused_cache_rows(inputs, block_size) > 0
        _same_bits(cupa.paged_attention(**inputs, **attrs), cupa.paged_attention(**clean, **attrs))


# ---------------------------------------------------------------------------------------------- ring

def _ring_vs_full(rng, *, W, bs, prompts, steps, H=4, Hk=2, D=32, cache="T", sink=False, quant="PER_TENSOR",
                  compare_full_attention=False, zero_steps=False):
    """Decode `steps` tokens per sequence after `prompts`; the ring-buffer run must bit-match the full run.

    Full run: every position has its own block (derived slots). Ring run: N = ceil(W/bs)+1 blocks per
    sequence recycled through slot_mapping; block_table entries below the live window are -1.
    """
    B = len(prompts)
    T = np.float16
    Nring = math.ceil(W / bs) + 1
    L_max = max(prompts) + steps
    MB = math.ceil(L_max / bs) + 1
    proto = util.make_case(rng, num_heads=H, kv_num_heads=Hk, head_size=D, block_size=bs,
                           q_lens=(1,) * B, past=(0,) * B, cache=cache, k_quant=quant, v_quant=quant,
                           sink=sink, rotary="half", max_position=L_max + 2, window=W)
    attrs = dict(proto.attrs)
    if compare_full_attention:
        attrs_full = {k: v for k, v in attrs.items() if k != "local_window_size"}
    else:
        attrs_full = attrs
    kinds = proto.inputs["key_cache"]
    # full cache: B*MB private blocks; ring cache: B*Nring blocks; both start as the same garbage
    full_kc = util._random_cache(rng, (B * MB, bs, Hk, D), cache, T, 100).view(kinds.dtype)
    full_vc = util._random_cache(rng, (B * MB, bs, Hk, D), cache, T, 100).view(kinds.dtype)
    ring_kc = util._random_cache(rng, (B * Nring, bs, Hk, D), cache, T, 100).view(kinds.dtype)
    ring_vc = util._random_cache(rng, (B * Nring, bs, Hk, D), cache, T, 100).view(kinds.dtype)
    full_perm = rng.permutation(B * MB).reshape(B, MB).astype(np.int32)
    ring = rng.permutation(B * Nring).reshape(B, Nring)
    shared = {n: proto.inputs[n] for n in ("cos_cache", "sin_cache", "head_sink", "k_scale", "v_scale")}
    lengths = np.zeros(B, dtype=np.int64)
    compared_past_window = 0

    def step(q_lens):
        nonlocal compared_past_window
        N = int(q_lens.sum())
        cum = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        past = lengths.astype(np.int32)
        pos = np.concatenate([lengths[b] + np.arange(q_lens[b]) for b in range(B)]).astype(np.int64)
        owner = np.repeat(np.arange(B), q_lens)
        q = util._rand_T(rng, (N, H * D), T)
        k = util._rand_T(rng, (N, Hk * D), T)
        v = util._rand_T(rng, (N, Hk * D), T)
        common = dict(query=q, key=k, value=v, cumulative_sequence_length=cum, past_seqlens=past,
                      **{n: a for n, a in shared.items() if a is not None})
        out_full = cupa.paged_attention(key_cache=full_kc, value_cache=full_vc, block_table=full_perm,
                                             **common, **attrs_full)
        # ring: live blocks from the window start of the earliest query to the last position
        ring_bt = np.full((B, MB), -1, np.int32)
        for b in range(B):
            if q_lens[b] == 0 and lengths[b] == 0:
                continue
            p_min = lengths[b]
            p_max = lengths[b] + max(q_lens[b], 1) - 1
            first = max(0, p_min - W + 1) // bs
            for i in range(first, p_max // bs + 1):
                ring_bt[b, i] = ring[b, i % Nring]
        slots = np.array([ring[b, (p // bs) % Nring] * bs + p % bs for b, p in zip(owner, pos)], np.int64)
        out_ring = cupa.paged_attention(key_cache=ring_kc, value_cache=ring_vc, block_table=ring_bt,
                                             slot_mapping=slots.astype(np.int32), **common, **attrs)
        _same_bits(out_ring, out_full, f"step output (lengths {lengths.tolist()})")
        if (lengths + q_lens > W).any():
            compared_past_window += 1
        lengths[:] += q_lens

    step(np.asarray(prompts, dtype=np.int64))          # prefill (prompt <= W: no wrap inside one call)
    for _ in range(steps):
        step(rng.integers(0, 2, B) if zero_steps else np.ones(B, dtype=np.int64))
    return compared_past_window


@pytest.mark.parametrize("W,bs", [(8, 4), (5, 4), (16, 16), (3, 1), (7, 8)])
def test_ring_buffer_window_matches_full_cache(rng, W, bs):
    past_window = _ring_vs_full(rng, W=W, bs=bs, prompts=[W, 1, max(1, W // 2)], steps=3 * W + 4)
    assert past_window >= 2 * W


@pytest.mark.parametrize("cache,quant,sink", [("int8", "PER_CHANNEL", True), ("fp8_bytes", "PER_TENSOR", True),
                                              ("fp8", "PER_CHANNEL", False)])
def test_ring_buffer_quantized_with_sink(rng, cache, quant, sink):
    _ring_vs_full(rng, W=6, bs=4, prompts=[6, 2], steps=20, cache=cache, quant=quant, sink=sink)


def test_ring_buffer_mixed_batch_and_zero_token_steps(rng):
    """Some sequences past the window, some not; ring run bit-matches at every step."""
    _ring_vs_full(rng, W=12, bs=4, prompts=[12, 1, 3, 7], steps=14)
    _ring_vs_full(rng, W=7, bs=2, prompts=[7, 0, 3], steps=24, zero_steps=True)


def test_ring_window_ge_length_equals_full_attention(rng):
    """W >= L: nothing is ever evicted and the windowed ring run equals unwindowed attention."""
    _ring_vs_full(rng, W=64, bs=8, prompts=[20, 5], steps=10, compare_full_attention=True)


# ---------------------------------------------------------------------------------------------- metadata

@pytest.mark.parametrize("opts", [dict(), dict(qk_output=1, sink=True), dict(qk_output=2, window=4, cache="int8")])
def test_metadata_absent_tight_loose_identical(rng, opts):
    base = util.make_case(rng, q_lens=(1, 1, 1, 3), past=(9, 30, 0, 17), **opts)
    results = {}
    tight_kv = int((base.past + base.q_lens).max())
    for md in (None, "tight", "loose"):
        c = base.copy()
        if md == "tight":
            c.inputs["attention_metadata"] = np.array([3, tight_kv], np.int32)
        elif md == "loose":
            c.inputs["attention_metadata"] = np.array([100, 10 ** 6, 7], np.int32)
        results[md] = (c.run(), c)
    ref, ref_case = results[None]
    for md in ("tight", "loose"):
        r, c = results[md]
        _same_bits(_out(r), _out(ref), f"output ({md})")
        _same_bits(c.inputs["key_cache"], ref_case.inputs["key_cache"], "key_cache")
        if isinstance(r, tuple):
            w = r[1].shape[2]
            assert w == (tight_kv if md == "tight" else ref[1].shape[2])
            _same_bits(r[1], ref[1][:, :, :w], f"output_qk ({md})")
            assert np.all(ref[1][:, :, tight_kv:] == 0)

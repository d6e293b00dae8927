"""CUDA prefill backend (prologue + tensor-core row tiles over the pages) against the NumPy reference.

Quick tier: the unmarked-slow tests (run after every kernel change). Full matrix: `slow`.
Every run draws fresh random data, poisons the output with NaN and checks every element and
cache byte (tests/util.py). Each case asserts first that dispatch picks the prefill backend.
On compute capability 9.0 the wgmma prefill serves most of these calls by default; every test here
runs with cupa.Options(backend="prefill") so that the mma.sync kernel stays checked on the device we
have (tests/gpu/test_prefill_wgmma.py checks the wgmma kernel).
"""

import numpy as np
import pytest

import cupa
from tests import util

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def mma_sync_prefill(monkeypatch):
    """The mma.sync prefill, also where the wgmma prefill would serve the call."""
    monkeypatch.setattr(util, "OPTIONS", cupa.Options(backend="prefill"))


def chosen_backend(cp, inputs, attrs, metadata=None) -> str:
    text = cupa.PagedAttention(**attrs).explain(**util.to_device(cp, inputs), attention_metadata=metadata)
    return next(line.split(":")[0] for line in text.splitlines() if ": chosen" in line)


def check_prefill(cp, inputs, attrs, *, dtype="float16", cache="T", metadata=None):
    assert chosen_backend(cp, inputs, attrs, metadata) == "prefill"
    return util.check_against_reference(cp, inputs, attrs, dtype=dtype, cache=cache, metadata=metadata)


def reversed_positions(inputs):
    """query_positions holding each sequence's positions in reverse order (each slot written once)."""
    cum, past = inputs["cumulative_sequence_length"], inputs["past_seqlens"]
    pos = inputs["query_positions"]
    for b in range(len(past)):
        pos[cum[b]:cum[b + 1]] = pos[cum[b]:cum[b + 1]][::-1]


# ---- quick tier -----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_prefill_ragged(cp, rng, dtype):
    inputs, attrs = util.build(rng, q_lens=[37, 0, 64], past=[0, 0, 0], H=8, Hk=2, D=128, dtype=dtype)
    check_prefill(cp, inputs, attrs, dtype=dtype)


def test_prefill_chunked(cp, rng):
    inputs, attrs = util.build(rng, q_lens=[300], past=[1000], H=8, Hk=2, D=128, block_size=16)
    check_prefill(cp, inputs, attrs)


def test_prefill_gqa_32_8(cp, rng):
    inputs, attrs = util.build(rng, q_lens=[100, 57], past=[0, 30], H=32, Hk=8, D=128, block_size=16, rotary=True)
    check_prefill(cp, inputs, attrs)


def test_prefill_int8(cp, rng):
    inputs, attrs = util.build(rng, q_lens=[45, 80], past=[20, 0], H=8, Hk=2, D=128, cache="int8",
                             k_quant="PER_CHANNEL", v_quant="PER_TENSOR")
    check_prefill(cp, inputs, attrs, cache="int8")


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("D,dtype,cache", [(128, "float16", "T"), (64, "bfloat16", "fp8"), (256, "float16", "T"),
                                           (128, "float16", "int8")])
def test_prefill_nan_in_unread_cache_rows(cp, rng, block_size, D, dtype, cache):
    """NaN (fp8: 0x7F) in every cache row no sequence reads -- past each sequence's last key, evicted and
    spare blocks -- never reaches the output (a tile's masked rows are zero-filled)."""
    inputs, attrs = util.build(rng, q_lens=[70, 0, 130, 9], past=[40, 5, 300, 0], H=8, Hk=2, D=D, dtype=dtype,
                             cache=cache, block_size=block_size, block_table="unmapped")
    assert util.poison_unused_cache_rows(inputs, block_size) > 0
    check_prefill(cp, inputs, attrs, dtype=dtype, cache=cache)


@pytest.mark.parametrize("variant", ["plain", "rotary_norm", "int8", "slot_mapping_skip"])
def test_prologue_several_tokens_per_cta(cp, rng, variant):
    """Enough tokens that the prologue groups 2+ tokens per CTA: plain 16-byte copies of several
    tokens, the per-row path token by token, and skipped writes (slot -1) among grouped tokens."""
    from cupa.kernels import launch, prologue

    kw = dict(q_lens=[1500, 0, 1450], past=[0, 7, 60], H=4, Hk=2, D=64, block_size=16)
    cache = "T"
    if variant == "rotary_norm":
        kw.update(rotary=True, qk_norm=True)
    elif variant == "int8":
        kw.update(cache="int8", k_quant="PER_CHANNEL", v_quant="PER_TENSOR")
        cache = "int8"
    inputs, attrs = util.build(rng, **kw)
    if variant == "slot_mapping_skip":
        slots = util.derived_slots(inputs, 16)
        for i in (0, 1, 5, 1501, 2949):
            slots[i] = -1
        inputs["slot_mapping"] = np.asarray(slots, dtype=np.int32)
    op = cupa.PagedAttention(**attrs)
    plan = op.plan(**util.to_device(cp, inputs))
    assert prologue.prologue_grid(plan.problem, plan.device.sm_count)[1] >= 2
    check_prefill(cp, inputs, attrs, cache=cache)


@pytest.mark.parametrize("variant", ["plain", "rotary_slot_skip"])
def test_prologue_plain_copies_in_many_passes(cp, rng, variant):
    """Grouped tokens whose plain rows take several passes of the prologue's copy loop (a warp copies a
    token's chunks 8 per lane and pass: PROLOGUE_U in prologue.cu): the later passes' loads come
    after the token lookup. Checked like every case."""
    from cupa.kernels import launch, prologue

    # MHA 24/24, D=128: 48 (plain) or 24 (rotary) rows of 16 chunks per token = 3 or 2 passes of
    # 32 lanes x 8 chunks; 2 tokens per CTA
    H = Hk = 24
    kw = dict(q_lens=[280] * 9 + [0, 290], past=[0, 5, 40, 0, 300, 7, 0, 16, 1, 3, 0], H=H, Hk=Hk, D=128)
    if variant == "rotary_slot_skip":
        kw.update(rotary=True)
    plain_rows = Hk if variant == "rotary_slot_skip" else 2 * Hk
    assert plain_rows * 128 * 2 // 16 > 8 * 32
    inputs, attrs = util.build(rng, **kw)
    if variant == "rotary_slot_skip":
        slots = util.derived_slots(inputs, 16)
        for i in (0, 2, 279, 280, 2000):
            slots[i] = -1
        inputs["slot_mapping"] = np.asarray(slots, dtype=np.int32)
    plan = cupa.PagedAttention(**attrs).plan(**util.to_device(cp, inputs))
    assert prologue.prologue_grid(plan.problem, plan.device.sm_count) == (1, 2)
    check_prefill(cp, inputs, attrs)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_prefill_new_keys_from_inputs(cp, rng, monkeypatch, dtype):
    """New K/V read from key/value (no past; new rows that are another sequence's past in the same call;
    the prologue beside the kernel): the reference, and the same bits as the cache route."""
    util.check_new_keys_cases(cp, rng, backend="prefill", dtype=dtype, head_sizes=(64, 128))


def test_prefill_window_sink_softcap(cp, rng):
    inputs, attrs = util.build(rng, q_lens=[90, 3, 40], past=[50, 7, 0], H=8, Hk=2, D=64, window=33, sink=True,
                             softcap=30.0)
    check_prefill(cp, inputs, attrs)


def test_prefill_deterministic_and_metadata_bits(cp, rng):
    inputs, attrs = util.build(rng, q_lens=[150, 20, 77], past=[0, 600, 33], H=16, Hk=4, D=128)
    cap = inputs["block_table"].shape[1] * 16
    outs = []
    for md in (None, [150, 620], [1000, cap], [150, 620, 100], None):
        fresh = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in inputs.items()}
        out, _ = check_prefill(cp, fresh, attrs, metadata=md)
        outs.append(cp.asnumpy(out).view(np.uint16))
    for o in outs[1:]:
        assert np.array_equal(o, outs[0]), "attention_metadata or a rerun changed the result bits"


def test_explain_chooses_prefill_for_many_tokens(cp, rng, monkeypatch):
    monkeypatch.setattr(util, "OPTIONS", None)
    inputs, attrs = util.build(rng, q_lens=[5, 3], past=[10, 10], H=8, Hk=2, D=128, cache="int8")
    text = cupa.PagedAttention(**attrs).explain(**util.to_device(cp, inputs))
    assert "prefill: chosen" in text and "token_count (8) > batch_size (2)" in text, text
    assert "decode: eligible but not preferred" in text, text
    # token_count == batch_size: decode-shaped, the decode backend runs it
    inputs, attrs = util.build(rng, q_lens=[1, 1], past=[10, 10], H=8, Hk=2, D=128)
    assert chosen_backend(cp, inputs, attrs) == "decode"


@pytest.mark.parametrize("case", ["float32", "head_size_96"])
def test_unsupported_shapes_fall_back_to_decode(cp, rng, monkeypatch, case):
    monkeypatch.setattr(util, "OPTIONS", None)
    kw = dict(dtype="float32") if case == "float32" else dict(D=96)
    inputs, attrs = util.build(rng, q_lens=[20, 9], past=[5, 0], H=4, Hk=2, **kw)
    text = cupa.PagedAttention(**attrs).explain(**util.to_device(cp, inputs))
    assert "prefill: not eligible" in text and "decode: chosen" in text, text
    util.check_against_reference(cp, inputs, attrs, dtype=kw.get("dtype", "float16"))


def test_prefill_graph_capture(cp, rng):
    """The call captures into a CUDA graph on a CuPy stream: proof of no host synchronization."""
    inputs, attrs = util.build(rng, q_lens=[40, 25], past=[100, 0], H=8, Hk=2, D=128)
    util.check_graph_capture(cp, inputs, attrs, metadata=[40, 140])


# ---- full matrix (slow) -----------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("block_size", [1, 8, 16, 64, 256, 512])
def test_matrix_block_sizes(cp, rng, block_size):
    inputs, attrs = util.build(rng, q_lens=[70, 0, 130, 1], past=[0, 300, 20, 700], H=8, Hk=2, D=128,
                             block_size=block_size)
    check_prefill(cp, inputs, attrs)


@pytest.mark.slow
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_matrix_head_sizes(cp, rng, D, dtype):
    inputs, attrs = util.build(rng, q_lens=[61, 130, 9], past=[0, 45, 300], H=8, Hk=2, D=D, dtype=dtype, rotary=True,
                             rotary_dim=min(D, 64))
    check_prefill(cp, inputs, attrs, dtype=dtype)


@pytest.mark.slow
@pytest.mark.parametrize("past", [0, 1000, 8192])
def test_matrix_chunked_prefill(cp, rng, past):
    inputs, attrs = util.build(rng, q_lens=[256, 64], past=[past, past // 2], H=8, Hk=2, D=128, block_size=16)
    check_prefill(cp, inputs, attrs)


@pytest.mark.slow
@pytest.mark.parametrize("H,Hk", [(4, 4), (6, 2), (8, 1), (32, 8), (40, 8), (64, 2), (128, 1), (256, 1)])
def test_matrix_groups(cp, rng, H, Hk):
    inputs, attrs = util.build(rng, q_lens=[33, 0, 20], past=[10, 5, 0], H=H, Hk=Hk, D=64)
    check_prefill(cp, inputs, attrs)


@pytest.mark.slow
def test_matrix_ragged_zero_token_sequences(cp, rng):
    inputs, attrs = util.build(rng, q_lens=[0, 5, 0, 133, 1, 0, 70, 0], past=[3, 0, 0, 40, 900, 0, 0, 17], H=8, Hk=2,
                             D=128)
    check_prefill(cp, inputs, attrs)


@pytest.mark.slow
@pytest.mark.parametrize("window", [-1, 1, 24])
def test_matrix_not_causal(cp, rng, window):
    inputs, attrs = util.build(rng, q_lens=[40, 7, 90], past=[0, 30, 64], H=8, Hk=2, D=64, is_causal=0, window=window)
    check_prefill(cp, inputs, attrs)


@pytest.mark.slow
@pytest.mark.parametrize("is_causal", [0, 1])
def test_matrix_query_positions(cp, rng, is_causal):
    # positions reversed within each sequence: every row of a tile has its own causal range
    inputs, attrs = util.build(rng, q_lens=[70, 2, 150], past=[10, 0, 64], H=8, Hk=2, D=128, query_positions=True,
                             is_causal=is_causal, window=50, rotary=True)
    reversed_positions(inputs)
    check_prefill(cp, inputs, attrs)


@pytest.mark.slow
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("rotary,interleaved", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("packed", [False, True])
def test_matrix_prologue(cp, rng, norm, rotary, interleaved, packed):
    inputs, attrs = util.build(rng, q_lens=[50, 0, 77], past=[0, 4, 31], H=8, Hk=2, D=128, qk_norm=norm, rotary=rotary,
                             interleaved=interleaved, packed=packed, rotary_dim=64, rotary_offset=32 if rotary else 0)
    check_prefill(cp, inputs, attrs)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("cache", ["int8", "fp8"])
@pytest.mark.parametrize("kq", ["PER_TENSOR", "PER_CHANNEL"])
@pytest.mark.parametrize("vq", ["PER_TENSOR", "PER_CHANNEL"])
def test_matrix_quant(cp, rng, dtype, cache, kq, vq):
    inputs, attrs = util.build(rng, q_lens=[64, 9, 100], past=[0, 200, 40], H=8, Hk=2, D=128, dtype=dtype, cache=cache,
                             k_quant=kq, v_quant=vq, rotary=True, sink=True)
    check_prefill(cp, inputs, attrs, dtype=dtype, cache=cache)


@pytest.mark.slow
@pytest.mark.parametrize("D", [64, 256])
@pytest.mark.parametrize("cache", ["int8", "fp8"])
def test_matrix_quant_head_sizes(cp, rng, D, cache):
    inputs, attrs = util.build(rng, q_lens=[64, 100], past=[7, 40], H=8, Hk=2, D=D, cache=cache,
                             k_quant="PER_CHANNEL", v_quant="PER_CHANNEL")
    check_prefill(cp, inputs, attrs, cache=cache)


@pytest.mark.slow
@pytest.mark.parametrize("table", ["shared", "unmapped"])
def test_matrix_block_tables(cp, rng, table):
    inputs, attrs = util.build(rng, q_lens=[50, 60, 30], past=[70, 80, 90], H=8, Hk=2, D=128, block_table=table,
                             block_size=16)
    check_prefill(cp, inputs, attrs)


@pytest.mark.slow
def test_matrix_slot_mapping_skip(cp, rng):
    inputs, attrs = util.build(rng, q_lens=[20, 31], past=[0, 5], H=8, Hk=2, D=64)
    slots = util.derived_slots(inputs, 16)
    slots[3] = -1
    slots[40] = -1
    inputs["slot_mapping"] = np.asarray(slots, dtype=np.int32)
    check_prefill(cp, inputs, attrs)


@pytest.mark.slow
def test_matrix_malformed_lengths_and_blocks(cp, rng):
    inputs, attrs = util.build(rng, q_lens=[12, 9, 30, 17, 6], past=[10, 20, 30, 40, 0], H=8, Hk=2, D=128,
                             query_positions=True)
    inputs["past_seqlens"][1] = -5                       # invalid sequence: zeros, no write
    inputs["past_seqlens"][2] = 10**6                    # beyond the table: invalid
    inputs["block_table"][3, 0] = 10**6                   # out-of-range block: masked
    inputs["query_positions"][60] = -3                    # invalid token: zeros, no write
    check_prefill(cp, inputs, attrs)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["padding", "leading_gap", "decreasing", "negative", "beyond_n"])
def test_matrix_malformed_cum(cp, rng, layout):
    """Tokens outside every sequence get zeros; any cum gives the reference's one outcome."""
    inputs, attrs = util.build(rng, q_lens=[20, 35, 9, 40], past=[5, 0, 60, 11], H=8, Hk=2, D=64)
    cum = inputs["cumulative_sequence_length"]
    N = int(cum[-1])
    if layout == "padding":          # trailing tokens that no sequence owns
        cum[-1] = N - 13
    elif layout == "leading_gap":
        cum[0] = 6
    elif layout == "decreasing":     # cum[2] < cum[1]: sequence 1 invalid, ownership by the binary search
        cum[2] = 10
    elif layout == "negative":
        cum[0] = -7
        cum[1] = 30
    else:                            # cum[B] beyond token_count
        cum[-1] = N + 50
        cum[-2] = N - 3
    check_prefill(cp, inputs, attrs)


@pytest.mark.slow
def test_matrix_large_batch_mixed(cp, rng):
    B = 300
    q_lens = [int(x) for x in rng.integers(0, 3, size=B)]
    q_lens[7] = 200
    inputs, attrs = util.build(rng, q_lens=q_lens, past=[int(x) for x in rng.integers(0, 300, size=B)], H=8, Hk=2, D=128)
    check_prefill(cp, inputs, attrs)

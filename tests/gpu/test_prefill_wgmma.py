"""The Hopper wgmma prefill (compute capability 9.0, chosen by default) against the NumPy reference.

Every case asserts that dispatch picks ``prefill_wgmma``, then checks every output element and cache
byte (tests/util.py). Skipped without a device, and on devices other than compute capability
9.0. Every case taking the ``wgmma_on`` fixture runs twice: with the K/V feed as chosen (TMA where it
applies) and with cp.async only (``cupa.Options(tma=False)``); test_persistent_ctas_many_items caps
the persistent CTAs so that each loops over many work items.
"""


import numpy as np
import pytest

import cupa
from cupa.options import _Tuning
from tests import util


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(util.device_capability() not in (None, (9, 0)),
                       reason="the wgmma prefill needs compute capability 9.0 (sm_90a)"),
]


@pytest.fixture(params=["tma", "cp_async"])
def wgmma_on(request, monkeypatch):
    """The backend at its default (chosen by dispatch), with its K/V feed as chosen (TMA where it applies)
    and with cp.async only."""
    monkeypatch.setattr(util, "OPTIONS", None if request.param == "tma" else cupa.Options(tma=False))


def chosen_backend(cp, inputs, attrs, metadata=None) -> str:
    text = cupa.PagedAttention(**attrs).explain(**util.to_device(cp, inputs), attention_metadata=metadata)
    return next(line.split(":")[0] for line in text.splitlines() if ": chosen" in line)


def check_wgmma(cp, inputs, attrs, *, dtype="float16", metadata=None):
    assert chosen_backend(cp, inputs, attrs, metadata) == "prefill_wgmma"
    return util.check_against_reference(cp, inputs, attrs, dtype=dtype, metadata=metadata)


def reversed_positions(inputs):
    cum, past = inputs["cumulative_sequence_length"], inputs["past_seqlens"]
    pos = inputs["query_positions"]
    for b in range(len(past)):
        pos[cum[b]:cum[b + 1]] = pos[cum[b]:cum[b + 1]][::-1]


# ---- first: one small case -------------------------------------------------------------------

def test_smoke_one_tile(cp, rng, wgmma_on):
    """One sequence of 16 tokens, MHA, block 16: one row tile, one key tile."""
    inputs, attrs = util.build(rng, q_lens=[16], past=[0], H=4, Hk=4, D=128, block_size=16)
    check_wgmma(cp, inputs, attrs)


def test_smoke_not_causal_full_tiles(cp, rng, wgmma_on):
    """Every row sees every key of two whole key tiles (the interior path, no per-element mask)."""
    inputs, attrs = util.build(rng, q_lens=[64], past=[64], H=2, Hk=1, D=128, block_size=64, is_causal=0)
    check_wgmma(cp, inputs, attrs)


# ---- the matrix ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_new_keys_from_inputs(cp, rng, monkeypatch, wgmma_on, dtype):
    """New K/V read from key/value (no past; new rows that are another sequence's past in the same call;
    the prologue beside the kernel): the reference, and the same bits as the cache route."""
    util.check_new_keys_cases(cp, rng, backend="prefill_wgmma", dtype=dtype, head_sizes=(128,))


@pytest.mark.parametrize("block_size", [1, 16, 64, 256])
def test_block_sizes(cp, rng, wgmma_on, block_size):
    inputs, attrs = util.build(rng, q_lens=[70, 0, 130], past=[0, 5, 40], H=8, Hk=2, D=128, block_size=block_size)
    check_wgmma(cp, inputs, attrs)


@pytest.mark.parametrize("is_causal", [0, 1])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_causal_and_not(cp, rng, wgmma_on, is_causal, dtype):
    inputs, attrs = util.build(rng, q_lens=[90, 33], past=[17, 0], H=8, Hk=2, D=128, is_causal=is_causal,
                             dtype=dtype)
    check_wgmma(cp, inputs, attrs, dtype=dtype)


@pytest.mark.parametrize("past", [0, 1000])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_chunked_prefill(cp, rng, wgmma_on, past, dtype):
    inputs, attrs = util.build(rng, q_lens=[300], past=[past], H=8, Hk=2, D=128, block_size=16, dtype=dtype)
    check_wgmma(cp, inputs, attrs, dtype=dtype)


def test_ragged_zero_token_sequences(cp, rng, wgmma_on):
    inputs, attrs = util.build(rng, q_lens=[37, 0, 64, 0, 1, 200, 0], past=[0, 9, 0, 3, 50, 12, 0], H=8, Hk=2,
                             D=128)
    check_wgmma(cp, inputs, attrs)


@pytest.mark.parametrize("H,Hk", [(32, 8), (4, 4), (8, 1)])
def test_groups(cp, rng, wgmma_on, H, Hk):
    inputs, attrs = util.build(rng, q_lens=[100, 57], past=[0, 30], H=H, Hk=Hk, D=128, block_size=16, rotary=True)
    check_wgmma(cp, inputs, attrs)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_window_sink_softcap(cp, rng, wgmma_on, dtype):
    inputs, attrs = util.build(rng, q_lens=[90, 3, 140], past=[50, 7, 0], H=8, Hk=2, D=128, window=33, sink=True,
                             softcap=30.0, dtype=dtype)
    check_wgmma(cp, inputs, attrs, dtype=dtype)


@pytest.mark.parametrize("window", [1, 24, 100])
def test_window_not_causal(cp, rng, wgmma_on, window):
    inputs, attrs = util.build(rng, q_lens=[80, 41], past=[30, 200], H=8, Hk=2, D=128, window=window, is_causal=0)
    check_wgmma(cp, inputs, attrs)


@pytest.mark.parametrize("is_causal", [0, 1])
def test_query_positions_reversed(cp, rng, wgmma_on, is_causal):
    inputs, attrs = util.build(rng, q_lens=[50, 70], past=[10, 0], H=8, Hk=2, D=128, query_positions=True,
                             is_causal=is_causal)
    reversed_positions(inputs)
    check_wgmma(cp, inputs, attrs)


@pytest.mark.parametrize("table", ["shared", "unmapped"])
def test_block_tables(cp, rng, wgmma_on, table):
    inputs, attrs = util.build(rng, q_lens=[60, 45], past=[40, 70], H=8, Hk=2, D=128, block_size=16, block_table=table)
    check_wgmma(cp, inputs, attrs)


def test_malformed_lengths_and_blocks(cp, rng, wgmma_on):
    inputs, attrs = util.build(rng, q_lens=[12, 9, 30, 17, 6], past=[10, 20, 30, 40, 0], H=8, Hk=2, D=128,
                             query_positions=True)
    inputs["past_seqlens"][1] = -5
    inputs["past_seqlens"][2] = 10**6
    inputs["block_table"][3, 0] = 10**6
    inputs["query_positions"][60] = -3
    check_wgmma(cp, inputs, attrs)


@pytest.mark.parametrize("layout", ["padding", "leading_gap", "decreasing"])
def test_malformed_cum(cp, rng, wgmma_on, layout):
    inputs, attrs = util.build(rng, q_lens=[20, 35, 9, 40], past=[5, 0, 60, 11], H=8, Hk=2, D=128)
    cum = inputs["cumulative_sequence_length"]
    N = int(cum[-1])
    if layout == "padding":
        cum[-1] = N - 13
    elif layout == "leading_gap":
        cum[0] = 6
    else:
        cum[2] = 10
    check_wgmma(cp, inputs, attrs)


def test_prologue_packed_rotary_norm(cp, rng, wgmma_on):
    inputs, attrs = util.build(rng, q_lens=[45, 80], past=[20, 0], H=8, Hk=2, D=128, packed=True, rotary=True,
                             qk_norm=True)
    check_wgmma(cp, inputs, attrs)


def test_metadata_does_not_change_bits(cp, rng, wgmma_on):
    inputs, attrs = util.build(rng, q_lens=[150, 20, 77], past=[0, 600, 33], H=16, Hk=4, D=128)
    outs = []
    for md in (None, [150, 620], None):
        fresh = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in inputs.items()}
        out, _ = check_wgmma(cp, fresh, attrs, metadata=md)
        outs.append(cp.asnumpy(out).view(np.uint16))
    for o in outs[1:]:
        assert np.array_equal(o, outs[0]), "attention_metadata or a rerun changed the result bits"


def test_graph_capture(cp, rng, wgmma_on):
    inputs, attrs = util.build(rng, q_lens=[40, 25], past=[100, 0], H=8, Hk=2, D=128)
    assert chosen_backend(cp, inputs, attrs) == "prefill_wgmma"
    util.check_graph_capture(cp, inputs, attrs, metadata=[40, 140])


def test_close_to_the_mma_sync_prefill(cp, rng):
    """The two prefill kernels agree far inside the reference tolerance (same inputs, fp32 accumulation)."""
    inputs, attrs = util.build(rng, q_lens=[200, 64], past=[100, 0], H=8, Hk=2, D=128)
    outs = {}
    for name in ("prefill_wgmma", "prefill"):
        named = util.with_options(attrs, backend=name)
        assert chosen_backend(cp, inputs, named) == name
        fresh = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in inputs.items()}
        out, _ = util.check_against_reference(cp, fresh, named)
        outs[name] = cp.asnumpy(out).astype(np.float32)
    assert util.rel_err(outs["prefill_wgmma"], outs["prefill"]) < 1e-3


@pytest.mark.parametrize("ctas", [1, 3, 7])
def test_persistent_ctas_many_items(cp, rng, monkeypatch, ctas):
    """The warp-specialized kernel with few persistent CTAs: each loops over many work items, so both Q
    buffers, both K/V stages and every mbarrier go through many phases, items without keys (a zero-token
    sequence, rows outside any range) are interleaved with long ones, and the consumers' turns carry
    across items. Ragged lengths, a past, a window on one call."""
    monkeypatch.setattr(util, "OPTIONS", cupa.Options(_tuning=_Tuning(prefill_ws_ctas=ctas)))
    inputs, attrs = util.build(rng, q_lens=[300, 0, 129, 1, 517], past=[0, 40, 1000, 7, 260], H=8, Hk=2, D=128,
                             block_size=16)
    check_wgmma(cp, inputs, attrs)
    inputs, attrs = util.build(rng, q_lens=[200, 333], past=[150, 0], H=16, Hk=2, D=128, block_size=1,
                             dtype="bfloat16", window=70)
    check_wgmma(cp, inputs, attrs, dtype="bfloat16")


@pytest.mark.parametrize("block_size", [1, 8, 24, 48, 64, 512])
@pytest.mark.parametrize("table", ["shuffled", "unmapped"])
def test_tma_boxes_and_masked_rows(cp, rng, wgmma_on, block_size, table):
    """Block sizes whose TMA boxes are 8 (8, 24), 16 (48) and 32 rows (64, 512) or none (1); evicted and
    out-of-range blocks (boxes from past the tensor: zeros); NaN in every cache row no sequence reads,
    so a masked row gathered into a tile (a sequence's last block, a box of masked keys) would show."""
    inputs, attrs = util.build(rng, q_lens=[70, 0, 130, 9], past=[40, 5, 300, 0], H=8, Hk=2, D=128,
                             block_size=block_size, block_table=table)
    assert util.poison_unused_cache_rows(inputs, block_size) > 0
    check_wgmma(cp, inputs, attrs)


@pytest.mark.parametrize("window", [33, 100])
@pytest.mark.parametrize("block_size", [16, 32])
def test_tma_windows_start_inside_a_box(cp, rng, wgmma_on, window, block_size):
    """Sliding windows: an item's first admitted key is rarely on a box boundary, so its tiles start on
    one below it and the keys in between are masked (the straddling boxes gathered by cp.async)."""
    inputs, attrs = util.build(rng, q_lens=[150, 61], past=[333, 17], H=8, Hk=2, D=128, block_size=block_size,
                             window=window)
    assert util.poison_unused_cache_rows(inputs, block_size, window=window) > 200  # (rows before the windows too)
    check_wgmma(cp, inputs, attrs)


@pytest.mark.parametrize("block_size", [16, 64])
def test_tma_reads_through_the_tensor_maps(cp, rng, monkeypatch, block_size):
    """The TMA feed really runs: with the value cache's tensor map pointed at a negated copy, the output
    moves far from the reference; with Options(tma=False) the same substitution changes nothing (no
    maps are used) and the output matches the reference."""
    from cupa.kernels import tma

    inputs, attrs = util.build(rng, q_lens=[64, 40], past=[512, 300], H=8, Hk=2, D=128, block_size=block_size)
    ref = cupa.paged_attention(**{k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in inputs.items()},
                               **attrs)
    encode = tma.rows_map
    for use_tma in (True, False):
        named = util.with_options(attrs, tma=use_tma)
        dev = util.to_device(cp, inputs)
        shadow = -dev["value_cache"]
        target = dev["value_cache"].data.ptr
        monkeypatch.setattr(tma, "rows_map", lambda ptr, *a: encode(shadow.data.ptr if ptr == target else ptr, *a))
        text = cupa.PagedAttention(**named).explain(**dev)
        assert ("cache rows by TMA in boxes of" in text) == use_tma, text
        out = cp.asnumpy(cupa.PagedAttention(**named)(**dev))
        err = util.rel_err(out, ref)
        assert (err > 0.5) if use_tma else (err < util.TOLERANCE["float16"]), (use_tma, err)


# ---- dispatch on the device --------------------------------------------------------------------

def test_explain_only_when_covered(cp, rng):
    inputs, attrs = util.build(rng, q_lens=[40, 30], past=[10, 0], H=8, Hk=2, D=128)
    named = util.with_options(attrs, backend="prefill")
    text = cupa.PagedAttention(**named).explain(**util.to_device(cp, inputs))
    assert "prefill: chosen" in text and "prefill_wgmma: not considered (options.backend='prefill')" in text, text
    text = cupa.PagedAttention(**attrs).explain(**util.to_device(cp, inputs))
    assert "prefill_wgmma: chosen" in text and "prefill: eligible but not preferred" in text, text
    for kw, reason in ((dict(D=64), "head_size 64"), (dict(cache="int8"), "int8 cache"),
                       (dict(dtype="float32"), "T=float32")):
        inputs, attrs = util.build(rng, q_lens=[40, 30], past=[10, 0], H=8, Hk=2, **{"D": 128, **kw})
        text = cupa.PagedAttention(**attrs).explain(**util.to_device(cp, inputs))
        assert "prefill_wgmma: not eligible" in text and reason in text, text
        assert "prefill_wgmma: chosen" not in text, text
    # decode-shaped calls stay with the decode backend
    inputs, attrs = util.build(rng, q_lens=[1, 1], past=[10, 10], H=8, Hk=2, D=128)
    assert chosen_backend(cp, inputs, attrs) == "decode"

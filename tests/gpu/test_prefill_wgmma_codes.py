"""The Hopper wgmma prefill over caches of 8-bit codes (int8, fp8 e4m3) against the NumPy reference.

The codes land in shared memory as they are and each copier warp widens its own rows in place
(cuda_src/prefill_wgmma_ws.cu); K's scale joins the score scale (per tensor) or Q's rows (per channel),
V's scale the epilogue. Every case names the backend (``cupa.Options(backend="prefill_wgmma")``, with the
K/V feed as chosen -- TMA where it applies -- and with cp.async only), asserts that it runs, and checks
every output element and cache byte (tests/util.py). Skipped without a device, and on devices other
than compute capability 9.0.
"""

import numpy as np
import pytest

import cupa
from tests import util


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(util.device_capability() not in (None, (9, 0)),
                       reason="the wgmma prefill needs compute capability 9.0 (sm_90a)"),
]

CACHES = ("int8", "fp8")


@pytest.fixture(params=["tma", "cp_async"])
def feed(request, monkeypatch):
    """The wgmma backend by name, with its K/V feed as chosen (TMA where it applies) and with cp.async only."""
    options = cupa.Options(backend="prefill_wgmma", tma=request.param == "tma")
    monkeypatch.setattr(util, "OPTIONS", options)
    return request.param


def check(cp, inputs, attrs, *, cache, dtype="float16", metadata=None):
    text = cupa.PagedAttention(**attrs).explain(**util.to_device(cp, inputs), attention_metadata=metadata)
    assert "prefill_wgmma: chosen" in text and f"{cache} codes widened" in text, text
    return util.check_against_reference(cp, inputs, attrs, dtype=dtype, cache=cache, metadata=metadata)


@pytest.mark.parametrize("cache", CACHES)
def test_smoke_one_tile(cp, rng, feed, cache):
    inputs, attrs = util.build(rng, q_lens=[16], past=[0], H=4, Hk=4, D=128, block_size=16, cache=cache)
    check(cp, inputs, attrs, cache=cache)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("kq", ["PER_TENSOR", "PER_CHANNEL"])
@pytest.mark.parametrize("vq", ["PER_TENSOR", "PER_CHANNEL"])
def test_scales(cp, rng, feed, dtype, cache, kq, vq):
    inputs, attrs = util.build(rng, q_lens=[64, 9, 150], past=[0, 200, 40], H=8, Hk=2, D=128, dtype=dtype,
                               cache=cache, k_quant=kq, v_quant=vq, rotary=True, sink=True)
    check(cp, inputs, attrs, cache=cache, dtype=dtype)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("block_size", [1, 16, 48, 64, 256])
def test_block_sizes(cp, rng, feed, cache, block_size):
    """Boxes of 8, 16 and 32 cache rows by TMA (block 16, 64, 256) and the cp.async gathers (1, 48)."""
    inputs, attrs = util.build(rng, q_lens=[70, 0, 130], past=[0, 5, 40], H=8, Hk=2, D=128, block_size=block_size,
                               cache=cache)
    check(cp, inputs, attrs, cache=cache)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("is_causal", [0, 1])
def test_chunked_and_not_causal(cp, rng, feed, cache, is_causal):
    inputs, attrs = util.build(rng, q_lens=[300, 41], past=[1000, 3], H=8, Hk=2, D=128, block_size=16, cache=cache,
                               is_causal=is_causal)
    check(cp, inputs, attrs, cache=cache)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("H,Hk", [(32, 8), (4, 4), (8, 1)])
def test_groups(cp, rng, feed, cache, H, Hk):
    inputs, attrs = util.build(rng, q_lens=[100, 57], past=[0, 30], H=H, Hk=Hk, D=128, block_size=16, cache=cache)
    check(cp, inputs, attrs, cache=cache)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("window,is_causal", [(33, 1), (1, 1), (24, 0)])
def test_windows_sink_softcap(cp, rng, feed, cache, window, is_causal):
    inputs, attrs = util.build(rng, q_lens=[90, 3, 140], past=[50, 7, 0], H=8, Hk=2, D=128, window=window,
                               is_causal=is_causal, sink=True, softcap=30.0, cache=cache)
    check(cp, inputs, attrs, cache=cache)


@pytest.mark.parametrize("cache", CACHES)
def test_ragged_tables_and_positions(cp, rng, feed, cache):
    inputs, attrs = util.build(rng, q_lens=[37, 0, 64, 0, 1, 200], past=[0, 9, 0, 3, 50, 12], H=8, Hk=2, D=128,
                               block_table="shared", query_positions=True, cache=cache)
    pos, cum = inputs["query_positions"], inputs["cumulative_sequence_length"]
    for b in range(len(cum) - 1):
        pos[cum[b]:cum[b + 1]] = pos[cum[b]:cum[b + 1]][::-1]
    check(cp, inputs, attrs, cache=cache)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("block_size", [1, 16])
def test_nan_codes_in_unread_rows(cp, rng, feed, cache, block_size):
    """NaN codes (fp8 0x7F; int8 has none, its rows are still poisoned with other codes) in every cache row
    no sequence reads never reach the output."""
    inputs, attrs = util.build(rng, q_lens=[70, 0, 130, 9], past=[40, 5, 300, 0], H=8, Hk=2, D=128, cache=cache,
                               block_size=block_size, block_table="unmapped")
    assert util.poison_unused_cache_rows(inputs, block_size) > 0
    check(cp, inputs, attrs, cache=cache)


@pytest.mark.parametrize("cache", CACHES)
def test_persistent_ctas_many_items(cp, rng, monkeypatch, cache):
    """8 persistent CTAs over many items: the copiers' count of tiles (and of their widening barriers'
    phases) carries across items, including items without tiles (rows past each sequence's end)."""
    from cupa.options import _Tuning

    monkeypatch.setattr(util, "OPTIONS", cupa.Options(backend="prefill_wgmma", _tuning=_Tuning(prefill_ws_ctas=8)))
    inputs, attrs = util.build(rng, q_lens=[300, 1, 0, 257, 129], past=[17, 400, 3, 0, 2000], H=8, Hk=2, D=128,
                               cache=cache)
    check(cp, inputs, attrs, cache=cache)


@pytest.mark.parametrize("cache", CACHES)
def test_close_to_the_mma_sync_prefill(cp, rng, cache):
    """The two prefills read the same codes and scales: their outputs agree within the contract's tolerance."""
    inputs, attrs = util.build(rng, q_lens=[200, 77], past=[64, 300], H=8, Hk=2, D=128, cache=cache)
    outs = []
    for backend in ("prefill_wgmma", "prefill"):
        dev = util.to_device(cp, inputs)
        outs.append(cp.asnumpy(cupa.paged_attention(**dev, options=cupa.Options(backend=backend), **attrs))
                    .astype(np.float64))
    assert np.linalg.norm(outs[0] - outs[1]) / np.linalg.norm(outs[1]) < 2e-3


@pytest.mark.parametrize("cache", CACHES)
def test_graph_capture_and_bits(cp, rng, cache, monkeypatch):
    """A captured call replays the eager result bit for bit, and two eager calls agree bit for bit."""
    monkeypatch.setattr(util, "OPTIONS", cupa.Options(backend="prefill_wgmma"))
    inputs, attrs = util.build(rng, q_lens=[90, 40], past=[30, 0], H=8, Hk=2, D=128, cache=cache)
    metadata = np.array([90, 120], dtype=np.int32)
    util.check_graph_capture(cp, inputs, attrs, metadata)
    runs = []
    for _ in range(2):
        dev = util.to_device(cp, inputs)
        runs.append(cp.asnumpy(cupa.paged_attention(**dev, **attrs)))
    assert runs[0].tobytes() == runs[1].tobytes()


@pytest.mark.parametrize("cache", CACHES)
def test_scales_four_bytes_off_alignment(cp, rng, feed, cache):
    """Per-channel scales in views that start 4 bytes past an allocation (contiguous, not 16-byte aligned):
    read element by element, within the reference's tolerance."""
    inputs, attrs = util.build(rng, q_lens=[70, 33], past=[20, 0], H=8, Hk=2, D=128, cache=cache,
                               k_quant="PER_CHANNEL", v_quant="PER_CHANNEL")
    ref_in = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in inputs.items()}
    ref = cupa.paged_attention(**ref_in, **util.host_attrs(attrs))
    dev = util.to_device(cp, inputs)
    for name in ("k_scale", "v_scale"):
        whole = cp.zeros(dev[name].size + 1, dtype=dev[name].dtype)
        whole[1:] = dev[name].ravel()
        dev[name] = whole[1:].reshape(dev[name].shape)
        assert dev[name].data.ptr % 16 == 4
    out = cp.full(ref.shape, np.nan, dtype=dev["query"].dtype)
    cupa.paged_attention(**dev, out=out, **attrs)
    cp.cuda.get_current_stream().synchronize()
    util.assert_matches_reference(cp.asnumpy(out), ref, "float16",
                                  [(n, cp.asnumpy(dev[n]), ref_in[n]) for n in ("key_cache", "value_cache")],
                                  cache=cache)

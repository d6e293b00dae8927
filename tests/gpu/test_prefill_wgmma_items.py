"""Work items without key tiles in the warp-specialized wgmma prefill (malformed data).

Rows whose tokens are all invalid (a negative query position) admit no key, so their work items have
no tiles: the consumers finish them at once, and the scheduler may publish the item after next into
the same buffer before the copiers have read this one. The info_empty handshake keeps each WsItem
until every copier thread has read it; without it a late copier reads the next item's fields, or sees
two phases under one parity (wrong K/V, or a hang on k_empty). Runs of such items sit between items
with tiles here, on one and two persistent CTAs (each loops over every item).
"""

import pytest

import cupa
from cupa.options import _Tuning
from tests import util

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cp():
    import cupy

    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the wgmma prefill needs compute capability 9.0")
    return cupy


@pytest.mark.parametrize("ctas", [1, 2])
@pytest.mark.parametrize("block_size", [16, 1])
def test_items_without_tiles_between_items_with_tiles(cp, rng, monkeypatch, ctas, block_size):
    options = cupa.Options(_tuning=_Tuning(prefill_ws_ctas=ctas))
    monkeypatch.setattr(util, "OPTIONS", options)
    inputs, attrs = util.build(rng, q_lens=[130, 300, 64, 200, 129, 70, 257], past=[10, 0, 500, 0, 33, 0, 90], H=8,
                             Hk=2, D=128, block_size=block_size, query_positions=True)
    pos, cum = inputs["query_positions"], inputs["cumulative_sequence_length"]
    for b in (1, 3, 5):  # every token invalid: 10, 7 and 3 row tiles x 2 KV heads of items without tiles
        pos[cum[b]:cum[b + 1]] = -1
    pos[cum[6]:cum[6] + 100] = -1  # and whole row tiles inside a sequence
    text = cupa.PagedAttention(**attrs).explain(**util.to_device(cp, inputs))
    assert "prefill_wgmma: chosen" in text, text
    out, _ = util.check_against_reference(cp, inputs, attrs)
    assert not cp.asnumpy(out)[pos < 0].any(), "invalid tokens output zeros"

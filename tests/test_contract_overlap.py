"""Buffers that must not alias: value_cache apart from key_cache (SEPARATE), out= apart from every input.

A shared K/V buffer would let V overwrite K silently; an out= over an input would be read after it is
written. Both are PagedAttentionErrors on the host path and on the device path (a fake CuPy here).
"""

import numpy as np
import pytest

import cupa
from tests import util
from tests.test_launch_fastpath import FakeCupy, fake_case, fake_cupy


def test_host_same_or_overlapping_caches(rng):
    inputs, attrs = util.build(rng, q_lens=[2, 1], past=[5, 9], H=4, Hk=2, D=16)
    with pytest.raises(cupa.PagedAttentionError, match="value_cache: got memory overlapping key_cache \\(the same "
                                                       "buffer\\); expected a cache of its own"):
        cupa.paged_attention(**{**inputs, "value_cache": inputs["key_cache"]}, **attrs)
    kc = inputs["key_cache"]
    pool = np.concatenate([kc, kc[:1]])            # one block more than a cache: two overlapping views
    with pytest.raises(cupa.PagedAttentionError, match="value_cache: got memory overlapping key_cache"):
        cupa.paged_attention(**{**inputs, "key_cache": pool[:-1], "value_cache": pool[1:]}, **attrs)


def test_host_out_overlapping_an_input(rng):
    inputs, attrs = util.build(rng, q_lens=[2, 1], past=[5, 9], H=4, Hk=2, D=16)
    q = inputs["query"]
    with pytest.raises(cupa.PagedAttentionError, match="out: got memory overlapping query"):
        cupa.paged_attention(**inputs, **attrs, out=q)
    ok = np.empty_like(q)
    assert cupa.paged_attention(**inputs, **attrs, out=ok) is ok


def test_device_same_caches_and_out_over_an_input():
    fake = FakeCupy()
    with fake_cupy(fake):
        x, attrs = fake_case(fake, B=2, L=64)
        op = cupa.PagedAttention(**attrs)
        op(**x)
        with pytest.raises(cupa.PagedAttentionError, match="value_cache: got memory overlapping key_cache \\(the "
                                                           "same buffer\\)"):
            op(**{**x, "value_cache": x["key_cache"]})
        q = x["query"]
        with pytest.raises(cupa.PagedAttentionError, match="out: got memory overlapping query"):
            op(**x, out=q)
        o = fake.empty(q.shape, q.dtype)
        assert op(**x, out=o) is o


def test_interleaved_pages_only_when_asked(rng):
    """transformers' paged cache: one buffer, V pages one page after K pages (block ids even). An error by
    default; accepted with Options(kv_pages_interleaved=True), where the result is that of separate caches.
    A shift by a fraction of a block stays an error."""
    inputs, attrs = util.build(rng, q_lens=[2, 1], past=[5, 9], H=4, Hk=2, D=16, spare_blocks=0)
    nb, bs, hk, d = inputs["key_cache"].shape
    buf = np.empty((2 * nb + 1, bs, hk, d), inputs["key_cache"].dtype)
    buf[0:2 * nb:2], buf[1:2 * nb + 1:2] = inputs["key_cache"], inputs["value_cache"]
    k_view, v_view = buf[:2 * nb], buf[1:2 * nb + 1]          # V = the buffer shifted by one page
    table = inputs["block_table"].copy()
    table[table >= 0] *= 2                                      # block b is page 2b of both views
    want_inputs = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in inputs.items()}
    want = cupa.paged_attention(**want_inputs, **attrs)
    shared = dict(inputs, key_cache=k_view, value_cache=v_view, block_table=table)
    with pytest.raises(cupa.PagedAttentionError, match="value_cache: got memory overlapping key_cache; expected "
                                                       "a cache of its own.*kv_pages_interleaved=True"):
        cupa.paged_attention(**shared, **attrs)
    got = cupa.paged_attention(**shared, **attrs, options=cupa.Options(kv_pages_interleaved=True))
    assert np.array_equal(got, want)
    assert np.array_equal(k_view[table[table >= 0]], want_inputs["key_cache"][inputs["block_table"][
        inputs["block_table"] >= 0]])
    flat = buf.reshape(-1)
    half = flat[d:d + k_view.size].reshape(k_view.shape)         # a shift of one row: not a whole block
    with pytest.raises(cupa.PagedAttentionError, match="by a fraction of a block"):
        cupa.paged_attention(**dict(shared, value_cache=half), **attrs, options=cupa.Options(kv_pages_interleaved=True))

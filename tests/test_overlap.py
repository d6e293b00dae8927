"""Buffers that must not alias: value_cache apart from key_cache (SEPARATE), out= apart from every input.

A shared K/V buffer would let V overwrite K silently; an out= over an input would be read after it is
written. Both are PagedAttentionErrors on the host path and on the device path (a fake CuPy here).
"""

import numpy as np
import pytest

import cupa
from tests import gpu_cases as gc
from tests.test_launch_fastpath import FakeCupy, fake_case, fake_cupy


def test_host_same_or_overlapping_caches(rng):
    inputs, attrs = gc.build(rng, q_lens=[2, 1], past=[5, 9], H=4, Hk=2, D=16)
    with pytest.raises(cupa.PagedAttentionError, match="value_cache: got memory overlapping key_cache; expected a "
                                                       "cache of its own"):
        cupa.paged_attention(**{**inputs, "value_cache": inputs["key_cache"]}, **attrs)
    kc = inputs["key_cache"]
    pool = np.concatenate([kc, kc[:1]])            # one block more than a cache: two overlapping views
    with pytest.raises(cupa.PagedAttentionError, match="value_cache: got memory overlapping key_cache"):
        cupa.paged_attention(**{**inputs, "key_cache": pool[:-1], "value_cache": pool[1:]}, **attrs)


def test_host_out_overlapping_an_input(rng):
    inputs, attrs = gc.build(rng, q_lens=[2, 1], past=[5, 9], H=4, Hk=2, D=16)
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

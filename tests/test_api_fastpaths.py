"""The per-call fast paths of PagedAttention: last-key memo check, keyword binding, metadata, out= check.

Each cached path must give the same answers as the first call: a change of any input's shape, dtype or
type, or of attention_metadata, after a cached call is seen on the very next call.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupa
from tests.test_launch_fastpath import FakeCupy, fake_case, fake_cupy

N, B, H, HK, D, NB, BS, MB = 3, 2, 4, 2, 16, 6, 4, 3


def _inputs():
    rng = np.random.default_rng(0)
    f = lambda *s: rng.standard_normal(s).astype(np.float16)  # noqa: E731
    return dict(query=f(N, H * D), key=f(N, HK * D), value=f(N, HK * D), key_cache=f(NB, BS, HK, D),
                value_cache=f(NB, BS, HK, D), cumulative_sequence_length=np.array([0, 1, 3], np.int32),
                past_seqlens=np.array([2, 1], np.int32), block_table=np.arange(B * MB, dtype=np.int32).reshape(B, MB))


def test_changed_shape_or_dtype_after_a_cached_call_raises():
    op = cupa.PagedAttention(num_heads=H, kv_num_heads=HK)
    x = _inputs()
    for _ in range(2):
        op.plan(**x)                                       # memo filled, then a last-key hit
    with pytest.raises(cupa.PagedAttentionError, match=r"past_seqlens: got shape \(3,\)"):
        op.plan(**{**x, "past_seqlens": np.zeros(3, np.int32)})
    with pytest.raises(cupa.PagedAttentionError, match="block_table: got dtype int64"):
        op.plan(**{**x, "block_table": x["block_table"].astype(np.int64)})
    op.plan(**x)
    bt = x["block_table"].copy()
    bt.shape = (MB, B)                                     # the same array object, reshaped in place
    with pytest.raises(cupa.PagedAttentionError, match="block_table: got shape"):
        op.plan(**{**x, "block_table": bt})
    with pytest.raises(cupa.PagedAttentionError, match="query: got a builtins.list"):
        op.plan(**{**x, "query": x["query"].tolist()})    # not an array: no memo, the rule's error
    assert op.plan(**x).problem.token_count == N                # and the cached entry still serves


def test_changed_metadata_after_a_cached_call_changes_the_plan():
    op = cupa.PagedAttention(num_heads=H, kv_num_heads=HK)
    x = _inputs()
    md = np.array([1, 8], np.int32)
    p1 = op.plan(**x, attention_metadata=md).problem
    assert op.plan(**x, attention_metadata=md).problem is p1
    md[1] = 5                                              # same array, new value in place
    p2 = op.plan(**x, attention_metadata=md).problem
    assert (p1.max_kv_len_bound, p2.max_kv_len_bound) == (8, 5)
    md[1] = -1
    with pytest.raises(cupa.PagedAttentionError, match="attention_metadata: got .*entries >= 0"):
        op.plan(**x, attention_metadata=md)
    with pytest.raises(cupa.PagedAttentionError, match="attention_metadata: got dtype int64"):
        op.plan(**x, attention_metadata=np.array([1, 8], np.int64))
    with pytest.raises(cupa.PagedAttentionError, match=r"attention_metadata: got shape \(4,\)"):
        op.plan(**x, attention_metadata=np.array([1, 8, 0, 0], np.int32))
    assert op.plan(**x, attention_metadata=[1, 8]).problem is p1   # same values, any host form: same key


def test_keyword_binding_fast_path_keeps_the_errors():
    op = cupa.PagedAttention(num_heads=H, kv_num_heads=HK)
    x = _inputs()
    args = tuple(x.values())
    assert op.plan(*args[:2], **{k: v for k, v in list(x.items())[2:]}).problem.token_count == N
    with pytest.raises(cupa.PagedAttentionError, match="key: got it both positionally"):
        op.plan(*args[:2], key=x["key"])
    with pytest.raises(cupa.PagedAttentionError, match="scale: got an unknown input name .*an attribute"):
        op.plan(*args, scale=1.0)
    with pytest.raises(cupa.PagedAttentionError, match="bogus: got an unknown input name"):
        op.plan(*args, bogus=1)


def test_device_call_after_cached_calls_checks_out_and_inputs_again():
    fake = FakeCupy()
    with fake_cupy(fake):
        x, attrs = fake_case(fake, B=2, L=64)
        op = cupa.PagedAttention(**attrs)
        q = x["query"]
        o = fake.empty(q.shape, q.dtype)
        assert op(**x, out=o) is o and op(**x, out=o) is o
        with pytest.raises(cupa.PagedAttentionError, match="out: got shape"):
            op(**x, out=fake.empty((q.shape[0], 8), q.dtype))
        with pytest.raises(cupa.PagedAttentionError, match="out: got dtype float32"):
            op(**x, out=fake.empty(q.shape, np.float32))
        with pytest.raises(cupa.PagedAttentionError, match="past_seqlens: got dtype int64"):
            op(**{**x, "past_seqlens": fake.empty((2,), np.int64)}, out=o)
        assert op(**x, out=o) is o

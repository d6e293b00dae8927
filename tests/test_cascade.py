"""cupa.CascadeAttention on the NumPy backend: equal to the plain paged call on the same inputs.

Sequences share their first prefix_len positions (the same physical blocks at the start of every
block-table row); the cascade step (prefix once for all tokens, suffix per sequence, merge) must give
the plain call's output within SPEC section 6 tolerances, its lse to float32 rounding, and the same
cache bytes.
"""

import numpy as np
import pytest

import cupa
from tests.util import T_DTYPES, assert_lse_close, assert_rel, make_case

COMMON = {
    "plain": {},
    "sink_softcap": dict(sink=True, softcap=2.0),
    "int8_per_channel": dict(cache="int8", k_quant="PER_CHANNEL", v_quant="PER_CHANNEL", sink=True),
    "fp8_bytes": dict(cache="fp8_bytes", k_quant="PER_TENSOR", v_quant="PER_CHANNEL"),
    "latent": dict(latent=True, v_head_size=24, scale=0.125),
    "qk_norm_packed": dict(qk_norm=True, packed=True, sink=True),
    "not_causal": dict(is_causal=0),
    "explicit_positions_slots": dict(positions="explicit", slot_mapping="skip"),
    "bf16_metadata": dict(dtype="bfloat16", metadata="loose", sink=True),
    "fp32_tight": dict(dtype="float32", metadata="tight"),
}
#: features whose prefix scores depend on positions: the "tokens" prefix only
POSITIONAL = {
    "rotary": dict(rotary="half", sink=True),
    "rotary_interleaved_window": dict(rotary="interleaved", window=7, qk_norm=True),
    "window": dict(window=5, cache="int8"),
}


def cascade_case(rng, prefix_len, block_size, own, q_lens, **features):
    """A case whose sequences all start with the same ``prefix_len`` cached positions (row 0's blocks)."""
    past = prefix_len + np.asarray(own)
    case = make_case(rng, block_size=block_size, q_lens=q_lens, past=past, num_heads=8, kv_num_heads=2,
                     head_size=32, **features)
    bt = case.inputs["block_table"]
    bt[:, :prefix_len // block_size] = bt[0, :prefix_len // block_size]
    return case


def _inputs(case):
    return {k: v for k, v in case.inputs.items() if v is not None}


def check_cascade(case, prefix_len, mode):
    plain = case.copy()
    want_out, want_lse = plain.run(return_lse=True)
    got_case = case.copy()
    op = cupa.CascadeAttention(prefix_len=prefix_len, prefix_mode=mode, return_lse=True, **case.attrs)
    out, lse = op(**_inputs(got_case))
    assert out.dtype == T_DTYPES[case.dtype] and out.shape == want_out.shape
    assert np.all(np.isfinite(out.astype(np.float32)))
    assert_rel(out, want_out, case.dtype, what="cascade output")
    assert_lse_close(lse, want_lse)
    for name in ("key_cache", "value_cache"):
        if plain.inputs[name] is not None:
            assert np.array_equal(got_case.inputs[name].view(np.uint8), plain.inputs[name].view(np.uint8)), name
    return op


@pytest.mark.parametrize("shape", ["decode", "prefill"])
@pytest.mark.parametrize("mode", ["heads", "tokens"])
@pytest.mark.parametrize("feature", sorted(COMMON))
def test_cascade_equals_the_plain_call(rng, feature, mode, shape):
    q_lens = (1, 1, 1, 1, 1) if shape == "decode" else (3, 1, 0, 4, 2)
    case = cascade_case(rng, 16, 4, own=(0, 5, 9, 2, 17), q_lens=q_lens, **COMMON[feature])
    check_cascade(case, 16, mode)


@pytest.mark.parametrize("splits", [2, 4, 6, 15])
@pytest.mark.parametrize("feature", ["plain", "sink_softcap", "int8_per_channel", "latent", "explicit_positions_slots"])
def test_heads_prefix_split_by_keys(rng, feature, splits):
    """The heads form with the shared keys in runs of whole blocks (6 blocks: 2 -> 2 runs of 3, 4 -> 3 of 2,
    6 and 15 -> 6 of 1), each run one sequence of the prefix call, merged with the suffix."""
    case = cascade_case(rng, 24, 4, own=(0, 5, 9, 2, 17), q_lens=(1, 2, 1, 0, 3), **COMMON[feature])
    op = cupa.CascadeAttention(prefix_len=24, prefix_mode="heads", prefix_splits=splits, return_lse=True,
                               **case.attrs)
    runs = {2: (2, 12), 4: (3, 8), 6: (6, 4), 15: (6, 4)}[splits]
    assert f"in {runs[0]} run(s) of up to {runs[1]} keys" in op.describe(**_inputs(case))
    plain = case.copy()
    want_out, want_lse = plain.run(return_lse=True)
    got = case.copy()
    out, lse = op(**_inputs(got))
    assert_rel(out, want_out, case.dtype, what="cascade output")
    assert_lse_close(lse, want_lse)
    for name in ("key_cache", "value_cache"):
        if plain.inputs[name] is not None:
            assert np.array_equal(got.inputs[name].view(np.uint8), plain.inputs[name].view(np.uint8)), name


def test_prefix_splits_for_fills_the_device():
    from cupa.cascade import MAX_PREFIX_SPLITS, prefix_splits_for

    # the benchmark case: 64 tokens x 4 heads a KV head = 2 row tiles x 8 KV heads; 132 SMs take 8 splits,
    # and half of them (concurrent with the suffix) 4; at least MIN_SPLIT_KEYS (512) keys a split
    assert prefix_splits_for(64, 32, 8, 8192, 16, 132) == 8
    assert prefix_splits_for(64, 32, 8, 8192, 16, 132, concurrent=True) == 4
    assert prefix_splits_for(64, 32, 8, 2048, 16, 132) == 4
    assert prefix_splits_for(64, 32, 8, 512, 16, 132) == 1
    assert prefix_splits_for(32, 32, 8, 4096, 16, 132, concurrent=True) == 8    # 8 row tiles: 8 runs of 512
    assert prefix_splits_for(128, 32, 8, 32768, 16, 132, concurrent=True) == 2  # 32 row tiles
    assert prefix_splits_for(4096, 32, 8, 65536, 16, 132) == 1       # the row tiles fill the device already
    assert prefix_splits_for(1, 8, 1, 1 << 20, 16, 1000) == MAX_PREFIX_SPLITS
    assert prefix_splits_for(1, 8, 8, 7 * 2048, 2048, 132) == 7      # whole blocks: 7 runs of one
    assert prefix_splits_for(1, 8, 8, 5 * 4096, 1024, 132) == 10     # 20 blocks: runs of 2 blocks


def test_prefix_splits_errors(rng):
    for bad in (0, 16, -1, 2.0, True, "many"):
        with pytest.raises(cupa.PagedAttentionError, match="^prefix_splits: "):
            cupa.CascadeAttention(prefix_len=8, prefix_splits=bad, num_heads=8, kv_num_heads=2)
    with pytest.raises(cupa.PagedAttentionError, match="^prefix_splits: got 2; expected 'auto' or 1 with "
                                                       "prefix_mode='tokens'"):
        cupa.CascadeAttention(prefix_len=8, prefix_mode="tokens", prefix_splits=2, num_heads=8, kv_num_heads=2)


@pytest.mark.parametrize("feature", sorted(POSITIONAL))
def test_cascade_with_positional_features_takes_the_tokens_prefix(rng, feature):
    case = cascade_case(rng, 12, 3, own=(1, 6, 0, 11), q_lens=(2, 1, 3, 1), **POSITIONAL[feature])
    op = check_cascade(case, 12, "auto")
    assert "prefix_mode='tokens'" in op.describe(**_inputs(case))
    with pytest.raises(cupa.PagedAttentionError, match="^prefix_mode: got 'heads'"):
        cupa.CascadeAttention(prefix_len=12, prefix_mode="heads", **case.attrs)


def test_auto_takes_the_heads_prefix_when_exact(rng):
    case = cascade_case(rng, 16, 8, own=(3, 4), q_lens=(1, 1))
    op = check_cascade(case, 16, "auto")
    assert "prefix_mode='heads'" in op.describe(**_inputs(case))


def test_more_tokens_than_prefix_positions(rng):
    """The tokens prefix with N > prefix_len: several prefix sequences of at most prefix_len tokens."""
    case = cascade_case(rng, 4, 4, own=(2, 0, 7), q_lens=(5, 3, 6), sink=True)
    op = check_cascade(case, 4, "tokens")
    assert "4 sequence(s) of the 14 tokens" in op.describe(**_inputs(case))


@pytest.mark.parametrize("mode", ["heads", "tokens"])
def test_invalid_and_unowned_tokens_output_zeros(rng, mode):
    case = cascade_case(rng, 8, 4, own=(3, 1, 6), q_lens=(2, 2, 3), sink=True)
    case.inputs["past_seqlens"][1] = -1                      # an invalid sequence
    case.inputs["cumulative_sequence_length"][-1] -= 2       # the last two tokens belong to no sequence
    plain_out = case.copy().run()
    assert not np.any(plain_out[2:4].astype(np.float32)) and not np.any(plain_out[-2:].astype(np.float32))
    check_cascade(case, 8, mode)


def test_cascade_function_and_torch_cpu_tensors(rng):
    torch = pytest.importorskip("torch")
    case = cascade_case(rng, 8, 4, own=(0, 2, 5), q_lens=(1, 1, 1), sink=True)
    want = case.copy().run()
    got = cupa.cascade_attention(**_inputs(case.copy()), prefix_len=8, **case.attrs)
    assert np.array_equal(got, cupa.CascadeAttention(prefix_len=8, **case.attrs)(**_inputs(case.copy())))
    assert_rel(got, want, case.dtype)
    t = {k: torch.from_numpy(v.copy()) for k, v in _inputs(case).items()}
    out = torch.empty(want.shape, dtype=torch.float16)
    res, lse = cupa.CascadeAttention(prefix_len=8, return_lse=True, **case.attrs)(**t, out=out)
    assert res is out and isinstance(lse, torch.Tensor) and lse.dtype == torch.float32
    assert np.array_equal(out.numpy(), got)


def test_no_tokens(rng):
    case = cascade_case(rng, 8, 4, own=(0, 2), q_lens=(0, 0))
    out, lse = cupa.CascadeAttention(prefix_len=8, return_lse=True, **case.attrs)(**_inputs(case))
    assert out.shape == (0, 8 * 32) and lse.shape == (0, 8)


def test_cascade_errors_name_the_input(rng):
    case = cascade_case(rng, 8, 4, own=(0, 2), q_lens=(1, 1), bias=(False, False))
    with pytest.raises(cupa.PagedAttentionError, match="^attention_bias: "):
        cupa.CascadeAttention(prefix_len=8, **case.attrs)(**_inputs(case))
    case.inputs["attention_bias"] = None
    with pytest.raises(cupa.PagedAttentionError, match=r"^prefix_len: got 6; expected a multiple of block_size \(4\)"):
        cupa.CascadeAttention(prefix_len=6, **case.attrs)(**_inputs(case))
    width = case.inputs["block_table"].shape[1] * 4
    with pytest.raises(cupa.PagedAttentionError, match="^block_table: got .* columns; expected more than"):
        cupa.CascadeAttention(prefix_len=width, **case.attrs)(**_inputs(case))
    with pytest.raises(cupa.PagedAttentionError, match="^qk_output: "):
        cupa.CascadeAttention(prefix_len=8, qk_output=1, **case.attrs)
    for bad in (0, -4, 2.0, True):
        with pytest.raises(cupa.PagedAttentionError, match="^prefix_len: "):
            cupa.CascadeAttention(prefix_len=bad, **case.attrs)
    with pytest.raises(cupa.PagedAttentionError, match="^prefix_mode: "):
        cupa.CascadeAttention(prefix_len=8, prefix_mode="rows", **case.attrs)
    for bad in (1, "yes", None):
        with pytest.raises(cupa.PagedAttentionError, match="^concurrent: got .*; expected True or False"):
            cupa.CascadeAttention(prefix_len=8, concurrent=bad, **case.attrs)
    rot = cascade_case(rng, 8, 4, own=(0, 2), q_lens=(1, 1), rotary="half", max_position=8)
    with pytest.raises(cupa.PagedAttentionError, match="^cos_cache: got 8 rows; expected more than prefix_len"):
        cupa.CascadeAttention(prefix_len=8, **rot.attrs)(**_inputs(rot))


def test_stack_units_keeps_the_copy_within_32_bit_indices():
    """cascade_inputs indexes the stacked copies in 32 bits: beyond MAX_STACK_UNITS units the host stacks."""
    from types import SimpleNamespace

    from cupa.kernels.states import MAX_STACK_UNITS, stack_units

    def query(rows, width, dtype=np.float16, ptr=256):
        item = np.dtype(dtype).itemsize
        return SimpleNamespace(ndim=2, dtype=np.dtype(dtype), data=SimpleNamespace(ptr=ptr),
                               strides=(width * item, item), shape=(rows, width))

    q = query(64, 32 * 128)
    assert stack_units(q, 128) == 16                              # 256-byte head rows
    heads = MAX_STACK_UNITS // 16 // 15
    assert stack_units(q, 128, heads, 15) == 16
    assert stack_units(q, 128, heads + 1, 15) is None
    assert stack_units(query(64, 32 * 128, ptr=258), 128) is None   # start off 16 bytes
    assert stack_units(query(64, 32 * 20, np.float32), 20) == 5
    assert stack_units(query(64, 32 * 12), 12) is None              # 24-byte head rows


def test_prefix_call_plans_write_nothing(rng):
    """The prefix call's slot_mapping is all -1, and its plans say so (dispatch.Plan.writes: a backend may
    leave out a launch that would only store rows); the plain call's and the suffix call's plans write."""
    case = cascade_case(rng, 8, 4, own=(0, 2), q_lens=(1, 1))
    op = cupa.CascadeAttention(prefix_len=8, **case.attrs)
    inputs = _inputs(case)
    op(**inputs)
    step = next(iter(op._steps.values()))
    assert not step.prefix_op._writes and (step.prefix_slots == -1).all()
    assert [e[1].writes for e in step.prefix_op._problems.values() if e[1] is not None] == [False]
    assert all(e[1].writes for e in op._suffix._problems.values() if e[1] is not None)
    assert cupa.PagedAttention(**case.attrs).plan(**inputs).writes

"""The JAX pattern of docs/integrations.md: JAX computes the queries, keys and values; the caches are
buffers owned outside JAX (NumPy or torch on the CPU, CuPy or torch on the GPU), written in place by
cupa; the output comes back as a JAX array.

CPU tests (JAX CPU arrays run the NumPy reference): a decode loop equals the same loop given NumPy
copies of JAX's projections, bit for bit, outputs and caches; inside ``jax.jit`` the call goes
through ``io_callback``.
GPU-marked tests run the loop with JAX GPU arrays and CuPy / torch caches against the reference.
"""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import cupa  # noqa: E402

H, HK, D, BLOCK, BATCH, STEPS = 4, 2, 16, 4, 3, 5


def setup(rng):
    """Projections of a toy decode step and the paged bookkeeping of BATCH sequences (NumPy)."""
    hidden = 32
    weights = {n: (rng.standard_normal((hidden, width)) / np.sqrt(hidden)).astype(np.float32)
               for n, width in (("q", H * D), ("k", HK * D), ("v", HK * D))}
    blocks_per_row = -(-(8 + STEPS) // BLOCK)
    block_table = rng.permutation(BATCH * blocks_per_row).astype(np.int32).reshape(BATCH, blocks_per_row)
    cache_shape = (BATCH * blocks_per_row, BLOCK, HK, D)
    caches = [rng.standard_normal(cache_shape).astype(np.float32) for _ in range(2)]
    past = rng.integers(0, 8, size=BATCH).astype(np.int32)
    hiddens = [rng.standard_normal((BATCH, hidden)).astype(np.float32) for _ in range(STEPS)]
    return weights, block_table, caches, past, hiddens


def decode_loop(weights, block_table, key_cache, value_cache, past, hiddens, host=False, call=cupa.paged_attention):
    """STEPS decode steps: JAX projects, cupa attends; ``host=True`` hands cupa NumPy copies of JAX's results.

    Returns the outputs of every step.
    """
    w = {n: jnp.asarray(m) for n, m in weights.items()}
    cum = np.arange(BATCH + 1, dtype=np.int32)
    outputs = []
    for step, x in enumerate(hiddens):
        x = jnp.asarray(x)
        q, k, v = x @ w["q"], x @ w["k"], x @ w["v"]
        if host:
            q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
        outputs.append(call(q, k, v, key_cache, value_cache, cum, past + step, block_table,
                            num_heads=H, kv_num_heads=HK))
    return outputs


def test_jax_inputs_with_numpy_caches_equal_numpy(rng):
    weights, bt, (kc, vc), past, hiddens = setup(rng)
    want_k, want_v = kc.copy(), vc.copy()
    want = decode_loop(weights, bt, want_k, want_v, past, hiddens, host=True)
    got = decode_loop(weights, bt, kc, vc, past, hiddens)
    for g, w in zip(got, want):
        assert isinstance(g, jax.Array)
        np.testing.assert_array_equal(np.asarray(g), w)
    np.testing.assert_array_equal(kc, want_k)
    np.testing.assert_array_equal(vc, want_v)


def test_jax_inputs_with_torch_caches_equal_numpy(rng):
    torch = pytest.importorskip("torch")
    weights, bt, (kc, vc), past, hiddens = setup(rng)
    want_k, want_v = kc.copy(), vc.copy()
    want = decode_loop(weights, bt, want_k, want_v, past, hiddens, host=True)
    tk, tv = torch.from_numpy(kc.copy()), torch.from_numpy(vc.copy())
    got = decode_loop(weights, bt, tk, tv, past, hiddens)
    for g, w in zip(got, want):
        assert isinstance(g, jax.Array)
        np.testing.assert_array_equal(np.asarray(g), w)
    np.testing.assert_array_equal(tk.numpy(), want_k)
    np.testing.assert_array_equal(tv.numpy(), want_v)


def test_jit_through_io_callback(rng):
    """Under jax.jit the caches stay outside JAX: an ordered io_callback runs the call on host values."""
    from jax.experimental import io_callback

    weights, bt, (kc, vc), past, hiddens = setup(rng)
    want_k, want_v = kc.copy(), vc.copy()
    cum = np.arange(BATCH + 1, dtype=np.int32)
    w = {n: jnp.asarray(m) for n, m in weights.items()}

    def attend(q, k, v, past_now):
        return cupa.paged_attention(q, k, v, kc, vc, cum, past_now, bt, num_heads=H, kv_num_heads=HK)

    @jax.jit
    def project(x):
        return x @ w["q"], x @ w["k"], x @ w["v"]

    @jax.jit
    def step(x, past_now):
        q, k, v = project(x)
        out = io_callback(attend, jax.ShapeDtypeStruct((BATCH, H * D), jnp.float32), q, k, v, past_now,
                          ordered=True)
        return out, (q, k, v)

    for i, x in enumerate(hiddens):
        out, qkv = step(jnp.asarray(x), jnp.asarray(past + i))
        want = cupa.paged_attention(*map(np.asarray, qkv), want_k, want_v, cum, past + i, bt, num_heads=H,
                                    kv_num_heads=HK)
        np.testing.assert_array_equal(np.asarray(out), want)
    np.testing.assert_array_equal(kc, want_k)
    np.testing.assert_array_equal(vc, want_v)


def test_a_jax_cache_is_an_error(rng):
    weights, bt, (kc, vc), past, hiddens = setup(rng)
    with pytest.raises(cupa.PagedAttentionError, match="key_cache"):
        decode_loop(weights, bt, jnp.asarray(kc), vc, past, hiddens[:1])


# -- GPU ----------------------------------------------------------------------------------------------

@pytest.fixture
def jax_gpu():
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("JAX has no GPU backend")


@pytest.mark.gpu
@pytest.mark.parametrize("owner", ["cupy", "torch"])
def test_jax_gpu_inputs_with_device_caches(rng, jax_gpu, owner):
    from .util import assert_cache_close, assert_rel

    weights, bt, (kc, vc), past, hiddens = setup(rng)
    want_k, want_v = kc.copy(), vc.copy()
    want = decode_loop(weights, bt, want_k, want_v, past, hiddens, host=True)
    if owner == "cupy":
        cp = pytest.importorskip("cupy")
        dk, dv, dbt = cp.asarray(kc), cp.asarray(vc), cp.asarray(bt)
        to_host = cp.asnumpy
    else:
        torch = pytest.importorskip("torch")
        dk, dv, dbt = (torch.from_numpy(a).cuda() for a in (kc, vc, bt))
        to_host = lambda t: t.cpu().numpy()  # noqa: E731
    with jax.default_device(jax_gpu):
        got = decode_loop(weights, dbt, dk, dv, jnp.asarray(past), hiddens,
                          call=lambda q, k, v, kc_, vc_, cum, p, b, **a: cupa.paged_attention(
                              q, k, v, kc_, vc_, jnp.asarray(cum), p, b, **a))
    for g, w in zip(got, want):
        assert isinstance(g, jax.Array) and g.devices() == {jax_gpu}
        assert_rel(np.asarray(g), w, "float32")
    assert_cache_close(to_host(dk), want_k, steps=1, what="key_cache")
    assert_cache_close(to_host(dv), want_v, steps=1, what="value_cache")

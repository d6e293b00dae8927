"""A key a token does not admit never reaches that token, on the CUDA backends (contract §4.4).

The cases of tests/isolation.py (every mask kind; same tile and chunk, other sequences of the batch;
NaN/Inf in cache rows and in the new K/V) run on CuPy arrays on one named backend
(``cupa.Options(backend=...)``: decode, prefill, prefill_wgmma, and mla and general where they
serve the case), once clean and once poisoned. The clean run must match the reference
(contract §6 tolerance, every element written); in the poisoned run every token that admits no
poisoned row must be bit-identical to the clean run: output, and output_qk and lse where the backend
serves them. A backend that does not serve a case skips it with its reasons.
"""

import numpy as np
import pytest

import cupa
from cupa import dispatch
from tests import isolation, util

pytestmark = pytest.mark.gpu

BACKENDS = ("decode", "prefill", "prefill_wgmma", "prefill_wgmma[copier_clean]", "mla", "general")
#: the CUDA-side cache kinds (CuPy holds fp8 as e4m3 bytes)
CACHES = tuple(c for c in isolation.CACHES if c[0] != "fp8")
MASKS = isolation.MASKS


def _problem(cp, case, **extra):
    op = cupa.PagedAttention(**dict(case.attrs, **extra))
    return op._problem(op._bind((), util.to_device(cp, case.inputs)))


def _serving_reasons(cp, case, backend, **extra) -> list:
    """Why ``backend`` cannot serve ``case`` with the attributes ``extra`` (empty: it serves it)."""
    from cupa.device import device_info

    problem = _problem(cp, case, **extra)
    named = [b for b in dispatch.cuda_backends() if b.name == util.backend_options(backend).backend]
    if not named:
        return [f"no backend named {backend!r} here"]
    return named[0].not_supported_reasons(problem, device_info(cp.cuda.runtime.getDevice()), cupa.Options())


def _run(cp, case, backend, **extra):
    """One call on CuPy copies of the case's inputs with output poisoned (NaN); host results."""
    dev = util.to_device(cp, case.inputs)
    out = cp.full(_problem(cp, case, **extra).output_shape, np.nan, dtype=dev["query"].dtype)
    result = cupa.paged_attention(**dev, out=out, options=util.backend_options(backend), **dict(case.attrs, **extra))
    result = result if isinstance(result, tuple) else (result,)
    cp.cuda.get_current_stream().synchronize()
    return tuple(cp.asnumpy(r) for r in result)


@pytest.mark.parametrize("cache", [c[0] for c in CACHES])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_a_token_does_not_admit_never_reach_it(cp, rng, backend, mask, cache):
    opts = dict(dict(CACHES)[cache], head_size=128, num_heads=8, kv_num_heads=2)
    case = isolation.build(rng, mask, **opts)
    reasons = _serving_reasons(cp, case, backend)
    if reasons:
        pytest.skip(f"{backend}: " + "; ".join(reasons))
    variants = [dict()]
    for extra in (dict(return_lse=True), dict(qk_output=1), dict(qk_output=2, return_lse=True)):
        if not _serving_reasons(cp, case, backend, **extra):
            variants.append(extra)
    reference = util.split_result(case.copy().run(), 0, False)[0]
    checked = changed = 0
    for kind in ("partial", "cross"):
        dense = util.dense_attention(case)
        slots = isolation.choose(rng, case, dense, kind)
        dirty = isolation.poison(rng, case, dense, slots)
        for extra in variants:
            clean = _run(cp, case, backend, **extra)
            assert np.all(np.isfinite(clean[0].astype(np.float32))), "unwritten or non-finite output without poison"
            err = util.rel_err(clean[0], reference)
            assert err < util.TOLERANCE[case.dtype], f"clean run against the reference: relative error {err:.3g}"
            poisoned = _run(cp, dirty, backend, **extra)
            stats = isolation.check_isolated(clean, poisoned, dense, slots, qk_output=extra.get("qk_output", 0),
                                             return_lse=extra.get("return_lse", False))
            assert stats["exposed"] > 0
            checked += stats["checked"]
            changed += stats["changed"]
    assert checked > 0 and changed > 0, (checked, changed)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unadmitted_rows_all_nan(cp, rng, backend):
    """Every cache row no token admits is NaN (an uninitialized cache): the whole result is unchanged."""
    case = isolation.build(rng, "window", head_size=128, num_heads=8, kv_num_heads=2)
    reasons = _serving_reasons(cp, case, backend)
    if reasons:
        pytest.skip(f"{backend}: " + "; ".join(reasons))
    dense = util.dense_attention(case)
    NB, bs = case.inputs["key_cache"].shape[:2]
    dirty = case.copy()
    for s in set(range(NB * bs)) - set().union(*dense.admitted) - {int(x) for x in dense.slot if x >= 0}:
        dirty.inputs["key_cache"][s // bs, s % bs] = np.nan
        dirty.inputs["value_cache"][s // bs, s % bs] = np.nan
    clean, poisoned = _run(cp, case, backend), _run(cp, dirty, backend)
    np.testing.assert_array_equal(isolation._bits(clean[0]), isolation._bits(poisoned[0]))

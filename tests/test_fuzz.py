"""The differential fuzz (tests/fuzz.py): its configurations are valid calls, and on a GPU they match."""

import numpy as np
import pytest

import cupa
from tests import fuzz, util


def test_configurations_are_valid_calls_of_every_kind():
    """200 configurations pass validation and run on the reference; the draw covers the contract."""
    seen = set()
    for seed in range(1, 201):
        inputs, attrs, metadata, desc = fuzz.draw(seed)
        out, qk, lse = util.split_result(cupa.paged_attention(**inputs, attention_metadata=metadata, **attrs),
                                         desc["qk_output"], desc["return_lse"])
        assert np.isfinite(out.astype(np.float32)).all() or desc["cache"] != "T", desc
        assert (qk is not None) == bool(desc["qk_output"]) and (lse is not None) == desc["return_lse"]
        seen.update(desc["notes"])
        seen.update({f"qk_output={desc['qk_output']}", f"return_lse={desc['return_lse']}"})
        seen.update({f"cache={desc['cache']}", f"dtype={desc['dtype']}", f"bs={desc['block_size']}"})
        if desc["v_cache"] != desc["cache"]:
            seen.add("mixed 4-bit kinds")
    for want in ("decode", "prefill", "chunked", "mixed", "slot_mapping", "negative past", "empty cache",
                 "tight metadata", "cache=int8", "cache=fp8", "cache=int4", "cache=fp4", "dtype=bfloat16", "bs=1",
                 "bs=17", "qk_output=1", "qk_output=2", "return_lse=True"):
        assert want in seen, (want, sorted(seen))
    assert "mixed 4-bit kinds" in seen


def test_the_same_seed_draws_the_same_configuration():
    a, b = fuzz.draw(77), fuzz.draw(77)
    assert a[3] == b[3] and all(np.array_equal(a[0][k], b[0][k]) for k in a[0])


@pytest.mark.gpu
def test_gpu_fuzz_sample():
    """A sample of the fuzz on the device (the full run: python -m tests.fuzz --n 2000)."""
    bad = [r for r in (fuzz.check_one(seed) for seed in range(5000, 5060)) if not r["ok"]]
    assert not bad, "\n".join(f"seed {r['seed']} {r['notes']}: {r['backends']}" for r in bad)

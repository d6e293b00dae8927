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
                 "bs=17", "qk_output=1", "qk_output=2", "return_lse=True", "bias"):
        assert want in seen, (want, sorted(seen))
    assert "mixed 4-bit kinds" in seen


def test_scores_and_lse_are_compared_over_the_caches_as_written(rng):
    """output_qk and lse are checked against the reference run over the caches a backend wrote: a written code
    one off moves exactly that key's scores and the lse, and nothing when the caches are the reference's."""
    inputs, attrs = util.build(rng, B=3, H=8, Hk=2, D=64, cache="int8", q_lens=[1, 5, 0], past=[7, 20, 3],
                               qk_output=1, return_lse=True)
    attrs = util.host_attrs(attrs)
    ref_in = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in inputs.items()}
    ref = util.split_result(cupa.paged_attention(**ref_in, **attrs), 1, True)
    written = (ref_in["key_cache"].copy(), ref_in["value_cache"].copy())
    assert util.qk_and_lse_reference(ref, inputs, ref_in, written, attrs) is ref
    # the reference's own caches, its write skipped: the same scores and lse bit for bit
    again = util.split_result(util.reference_over_written_caches(inputs, attrs, *written), 1, True)
    assert all(np.array_equal(a, b) for a, b in zip(again, ref))
    # one code of the newest key (sequence 1, position 24 = its last) one off, in KV head 1
    slot = int(inputs["slot_mapping"][5]) if "slot_mapping" in inputs else None
    blk = int(inputs["block_table"][1, 24 // 16]) if slot is None else slot // 16
    off = 24 % 16 if slot is None else slot % 16
    k = written[0].copy()
    k[blk, off, 1, 3] = np.int8(np.clip(int(k[blk, off, 1, 3]) + (1 if k[blk, off, 1, 3] < 127 else -1), -127, 127))
    out, qk, lse = util.qk_and_lse_reference(ref, inputs, ref_in, (k, written[1]), attrs)
    assert out is ref[0]
    changed = np.argwhere(qk != ref[1])
    assert changed.size and set(changed[:, 2]) == {24} and set(changed[:, 0]) <= set(range(4, 8))
    assert set(changed[:, 1]) <= set(range(1, 6)), "only sequence 1's tokens see its key 24"
    assert not np.array_equal(lse, ref[2])


def test_the_same_seed_draws_the_same_configuration():
    a, b = fuzz.draw(77), fuzz.draw(77)
    assert a[3] == b[3] and all(np.array_equal(a[0][k], b[0][k]) for k in a[0])


@pytest.mark.gpu
def test_gpu_fuzz_sample():
    """A sample of the fuzz on the device (the full run: python -m tests.fuzz --n 2000)."""
    bad = [r for r in (fuzz.check_one(seed) for seed in range(5000, 5060)) if not r["ok"]]
    assert not bad, "\n".join(f"seed {r['seed']} {r['notes']}: {r['backends']}" for r in bad)

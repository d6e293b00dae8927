"""Options(validate_data=True): the op checks the index inputs' values before it runs (off by default)."""

import numpy as np
import pytest

import cupa
from tests import util


def test_bad_values_raise_only_when_asked(rng):
    inputs, attrs = util.build(rng, q_lens=[2, 1], past=[5, 9], H=4, Hk=2, D=16)
    bad = dict(inputs, block_table=inputs["block_table"].copy())
    bad["block_table"][1, 0] = inputs["key_cache"].shape[0] + 3
    cupa.paged_attention(**{k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in bad.items()}, **attrs)
    with pytest.raises(cupa.PagedAttentionError, match=r"^block_table: got .*index"):
        cupa.paged_attention(**bad, **attrs, options=cupa.Options(validate_data=True))
    ok = cupa.paged_attention(**inputs, **attrs, options=cupa.Options(validate_data=True))
    assert ok.shape == (3, 64)


def test_torch_cpu_inputs_are_checked_too(rng):
    torch = pytest.importorskip("torch")
    inputs, attrs = util.build(rng, q_lens=[2, 1], past=[5, 9], H=4, Hk=2, D=16)
    t = {k: torch.from_numpy(v.copy()) for k, v in inputs.items()}
    t["past_seqlens"][0] = -4
    with pytest.raises(cupa.PagedAttentionError, match=r"^past_seqlens: got "):
        cupa.paged_attention(**t, **attrs, options=cupa.Options(validate_data=True))


@pytest.mark.gpu
def test_device_inputs_are_copied_back_and_checked(rng):
    cp = pytest.importorskip("cupy")
    inputs, attrs = util.build(rng, q_lens=[2, 1], past=[5, 9], H=4, Hk=2, D=64)
    dev = util.to_device(cp, inputs)
    dev["cumulative_sequence_length"][2] = 1
    with pytest.raises(cupa.PagedAttentionError, match=r"^cumulative_sequence_length: got "):
        cupa.paged_attention(**dev, **attrs, options=cupa.Options(validate_data=True))

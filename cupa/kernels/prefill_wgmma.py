"""The Hopper wgmma prefill backend (sm_90a): the prefill of choice on compute capability 9.0.

Same contract, launch layout, prologue and zero pass as the mma.sync prefill backend
(:mod:`cupa.kernels.prefill`); the attention kernel is ``paged_prefill_wgmma``
(cuda_src/prefill_wgmma.cu): one CTA = 2 warpgroups x 64 query rows of one sequence and one KV
head, S = Q K^T on ``wgmma.m64n64k16`` and O += P V on ``wgmma.m64n128k16`` with P in registers,
K/V rows gathered through the block table with cp.async into the 128B-swizzled layout wgmma reads.

It serves a call only when all of these hold, and otherwise says why in explain() (the call then
goes to the mma.sync prefill backend as before):

- ``CUPA_PREFILL_WGMMA`` is not ``"0"`` (the switch that sends these calls to the mma.sync prefill
  instead; read at dispatch: an op memoizes its choice per input signature, so set it before the
  op's first call or use a fresh op);
- the current device has compute capability 9.0 (wgmma needs the arch-specific sm_90a target,
  compiled offline with NVRTC and loaded as a cubin: :func:`cupa.jit.get_kernel` on a pinned spec);
- T is float16 or bfloat16, the caches hold T (no int8/fp8 caches in this first version), and
  head_size is 128;
- no LATENT layout, attention_bias or output_qk (as for the mma.sync prefill).
"""

from __future__ import annotations

import functools
import math
import os
from typing import Optional

from ..contract import Problem
from . import registry
from .prefill import MAX_GRID_X, PrefillBackend, prologue_phrase

#: The switch: "0" turns the backend off (validated on an H200: tests/test_prefill_wgmma_gpu.py).
ENV_VAR = "CUPA_PREFILL_WGMMA"
WGMMA_DTYPES = ("float16", "bfloat16")
WGMMA_HEAD_SIZES = (128,)
#: mirrors WgmmaPrefillConfig in prefill_wgmma.cu
ROWS, THREADS, KEYS, STAGES = 128, 256, 64, 2
CAPABILITY = (9, 0)


def enabled() -> bool:
    return os.environ.get(ENV_VAR, "") != "0"


@functools.lru_cache(maxsize=None)
def _capability_of(device_id: int) -> tuple:
    import cupy

    cc = cupy.cuda.Device(device_id).compute_capability  # e.g. "90"
    return (int(cc[:-1]), int(cc[-1]))


def device_capability() -> Optional[tuple]:
    """(major, minor) of the current CuPy device, or None where no device is usable."""
    try:
        import cupy

        return _capability_of(cupy.cuda.runtime.getDevice())
    except Exception:  # no cupy, no driver, no device
        return None


def shared_bytes(problem: Problem) -> int:
    """Dynamic shared memory of paged_prefill_wgmma (mirrors WgmmaPrefillSmem in prefill_wgmma.cu)."""
    D = problem.head_size
    q_bytes = ROWS * D * 2
    stage = 2 * KEYS * D * 2
    rows = (STAGES + 1) * KEYS * 8
    sizes = (STAGES + 1) * KEYS * 4
    mapped = (STAGES + 1) * (KEYS // 32) * 4
    align_pad = 1024  # the kernel rounds the dynamic region up to a 1024-byte boundary (swizzle atoms)
    return q_bytes + STAGES * stage + rows + sizes + mapped + align_pad


def launch_plan(problem: Problem) -> dict:
    """Grid of one call, from static sizes only (the same numbering as the mma.sync prefill)."""
    p = problem
    num_tiles = (p.token_count * p.group_size) // ROWS + p.batch_size
    zero_ctas = math.ceil(p.token_count / THREADS)  # one thread per token checks its ownership
    return {"rows": ROWS, "threads": THREADS, "num_tiles": num_tiles, "zero_ctas": zero_ctas,
            "grid": zero_ctas + num_tiles * p.kv_num_heads, "keys": KEYS, "stages": STAGES}


class PrefillWgmmaBackend(PrefillBackend):
    """The mma.sync prefill's run() (prologue, workspace, zero-token shortcut) with the wgmma kernel."""

    name = "prefill_wgmma"

    def not_supported_reasons(self, problem: Problem) -> list:
        p, reasons = problem, []
        if not enabled():
            reasons.append(f"switched off by {ENV_VAR}=0")
        if p.latent:
            reasons.append("kv_cache_layout='LATENT' (MLA) is not served by the wgmma prefill")
        if p.has_bias:
            reasons.append("attention_bias is not served by the wgmma prefill")
        if p.attrs.qk_output:
            reasons.append("output_qk (qk_output != 0) is not served by the wgmma prefill")
        if p.dtype not in WGMMA_DTYPES:
            reasons.append(f"T={p.dtype}: the wgmma prefill takes float16 or bfloat16")
        if p.quantized:
            reasons.append(f"{p.cache_kind} cache: the wgmma prefill takes caches of T only (this first version)")
        if p.head_size not in WGMMA_HEAD_SIZES:
            reasons.append(f"head_size {p.head_size}: the wgmma prefill takes {WGMMA_HEAD_SIZES[0]} only")
        if not reasons:
            cc = device_capability()
            if cc != CAPABILITY:
                have = "no usable CUDA device" if cc is None else f"compute capability {cc[0]}.{cc[1]}"
                reasons.append(f"needs compute capability 9.0 (sm_90a wgmma); {have}")
        if not reasons and launch_plan(p)["grid"] > MAX_GRID_X:
            reasons.append(f"{launch_plan(p)['grid']} CTAs exceed one launch's grid ({MAX_GRID_X})")
        return reasons

    def describe(self, problem: Problem) -> str:
        plan = launch_plan(problem)
        return (f"paged prefill on Hopper warpgroup MMA (wgmma m64n64k16 / m64n128k16, sm_90a; off with "
                f"{ENV_VAR}=0): one CTA of 2 warpgroups per (tile of {plan['rows']} (token, group head) rows of "
                f"one sequence, KV head); {plan['num_tiles']} row tiles x {problem.kv_num_heads} KV heads + "
                f"{plan['zero_ctas']} zero-pass CTA(s); keys in tiles of {plan['keys']} through a "
                f"{plan['stages']}-stage cp.async pipeline; {prologue_phrase(problem)}; token_count "
                f"({problem.token_count}) {'>' if self.preferred(problem) else '<='} batch_size "
                f"({problem.batch_size}): {'' if self.preferred(problem) else 'not '}preferred")

    def _spec(self, p: Problem):
        return registry.prefill_wgmma_spec(p.dtype, p.head_size)

    def _plan(self, p: Problem) -> dict:
        return launch_plan(p)

    def _shared_bytes(self, p: Problem) -> int:
        return shared_bytes(p)


BACKEND = PrefillWgmmaBackend()

"""``cupa.Options``: every choice a caller can make beyond the ONNX attributes, in one validated object.

An :class:`Options` is frozen and validated when it is built; a bad field raises
:class:`cupa.PagedAttentionError` naming the field, what it got and what it allows. It is passed as
``PagedAttention(..., options=...)`` or ``paged_attention(..., options=...)``, is part of the plan
memo's key (two ops with different options never share a plan), and ``explain()`` prints it.
``repr`` shows the fields that differ from the defaults.

Environment variables configure only the kernel cache directory (``CUPA_CACHE_DIR``), the CUDA
include path (``CUPA_CUDA_INCLUDE``) and the test seed (``CUPA_TEST_SEED``); nothing else in cupa
reads the environment.

:class:`_Tuning` holds the constants a benchmark sweeps (split targets, CTA counts). It is private:
its fields may change between releases, and its defaults are what the benchmarks measured best.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

from .errors import fail

__all__ = ["Options", "BACKEND_NAMES", "LAUNCH_ROUTES", "DEFAULT_OPTIONS"]

#: Backend names ``Options.backend`` accepts besides ``"auto"`` (dispatch.py lists them in priority order).
BACKEND_NAMES = ("reference", "prefill_wgmma", "prefill", "decode", "mla", "general")
#: ``Options.launch``: ``"fast"`` (cuLaunchKernel / cuLaunchKernelEx with a prebuilt parameter array) or
#: ``"rawkernel"`` (``cupy.RawKernel.__call__`` with the same argument values: the reference route).
LAUNCH_ROUTES = ("fast", "rawkernel")


def _flag(name: str, v) -> None:
    if not isinstance(v, bool):
        raise fail(name, f"{v!r} ({type(v).__name__})", "True or False")


def _positive_int(name: str, v, allow_none: bool = False) -> None:
    if v is None and allow_none:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise fail(name, f"{v!r} ({type(v).__name__})",
                   "a positive integer" + (" or None (the default)" if allow_none else ""))


@dataclass(frozen=True)
class _Tuning:
    """Constants that only a benchmark sweeps (private: no stability promise).

    Parameters
    ----------
    decode_ctas_per_sm : int, default 2
        CTAs per SM the decode split plan aims for over the static KV capacity.
    decode_keys_as_m : bool, default True
        8-bit caches with GQA groups of <= 8 heads: the decode loop with keys as the MMA's M dimension.
    prologue_beside_sms : int, default 32
        SMs of the prologue launched beside the prefill kernel (512-thread CTAs, one per SM).
    prefill_ws_ctas : int or None, default None
        Persistent CTAs of the warp-specialized wgmma prefill (None: one per SM).
    mla_wgmma : bool, default True
        Compute capability 9.0, 16-bit latent caches: the wgmma MLA kernel where a tile has 64 rows;
        False: the portable mma.sync kernel there too (A/B runs).
    mla_waves : int, default 1
        Waves of resident CTAs (every SM full) the MLA split plan aims for.
    prefill_ws_copier_clean : bool, default False
        The wgmma prefill over T caches: V tiles with keys to clean cleaned by the copier warps (each its own
        rows, once landed) instead of by the scheduler warpgroup (A/B runs).
    """

    decode_ctas_per_sm: int = 2
    decode_keys_as_m: bool = True
    prologue_beside_sms: int = 32
    prefill_ws_ctas: Optional[int] = None
    mla_wgmma: bool = True
    mla_waves: int = 1
    prefill_ws_copier_clean: bool = False

    def __post_init__(self):
        _positive_int("_tuning.decode_ctas_per_sm", self.decode_ctas_per_sm)
        _flag("_tuning.decode_keys_as_m", self.decode_keys_as_m)
        _positive_int("_tuning.prologue_beside_sms", self.prologue_beside_sms)
        _positive_int("_tuning.prefill_ws_ctas", self.prefill_ws_ctas, allow_none=True)
        _flag("_tuning.mla_wgmma", self.mla_wgmma)
        _positive_int("_tuning.mla_waves", self.mla_waves)
        _flag("_tuning.prefill_ws_copier_clean", self.prefill_ws_copier_clean)


@dataclass(frozen=True)
class Options:
    """Choices beyond the ONNX attributes: backend, launch route, byte limits, data validation.

    Parameters
    ----------
    backend : str, default "auto"
        ``"auto"``: the first backend in priority order that serves the call and has passed its GPU
        tests on a device. A name (:data:`BACKEND_NAMES`) runs that backend or raises
        PagedAttentionError saying why it cannot; a backend not yet verified on a GPU runs only when
        named here. ``"reference"`` is the NumPy backend (host inputs only: device inputs never fall
        back to the CPU).
    launch : {"fast", "rawkernel"}, default "fast"
        How kernels are launched: the driver with a prebuilt parameter array, or
        ``cupy.RawKernel.__call__`` (the same argument values; slower, for A/B checks).
    programmatic_launch : bool, default True
        On compute capability 9.0+, launch the attention kernel with programmatic dependent launch
        after the prologue (its preamble overlaps the prologue's tail). False: plain launches.
    new_kv_from_inputs : bool, default True
        Prefill kernels read the new tokens' K/V from ``key``/``value`` (the bits the prologue writes
        to the cache) where that is exact, so CTAs without a past run beside the prologue.
    tma : bool, default True
        The warp-specialized wgmma prefill feeds K/V rows with the bulk tensor copy engine where the
        layout allows; False: cp.async gathers only.
    output_qk_max_bytes : int, default 2**34
        An output_qk larger than this is refused with PagedAttentionError before anything is allocated.
    kv_pages_interleaved : bool, default False
        key_cache and value_cache may be views of one buffer whose K and V pages interleave, the value
        view starting a whole number of blocks after the key view (transformers' paged cache: one buffer,
        V pages shifted by one page, every block id even). Their address ranges then overlap by design,
        and the caller guarantees that no block id's K page is another block id's V page. Off: caches
        whose memory overlaps are an error (V would overwrite K).
    validate_data : bool, default False
        Also check the index inputs' values (cumulative_sequence_length, past_seqlens, block_table,
        slot_mapping, query_positions) and raise PagedAttentionError naming the input and the index of
        the first bad entry. On device inputs this copies them to the host and synchronizes: a debugging
        aid, never on by default.
    _tuning : _Tuning
        Benchmark knobs (private).
    """

    backend: str = "auto"
    launch: str = "fast"
    programmatic_launch: bool = True
    new_kv_from_inputs: bool = True
    tma: bool = True
    output_qk_max_bytes: int = 1 << 34
    kv_pages_interleaved: bool = False
    validate_data: bool = False
    _tuning: _Tuning = field(default_factory=_Tuning)

    def __post_init__(self):
        if self.backend != "auto" and self.backend not in BACKEND_NAMES:
            raise fail("options.backend", repr(self.backend), "'auto' or one of " + ", ".join(map(repr, BACKEND_NAMES)))
        if self.launch not in LAUNCH_ROUTES:
            raise fail("options.launch", repr(self.launch), "one of " + ", ".join(map(repr, LAUNCH_ROUTES)))
        for name in ("programmatic_launch", "new_kv_from_inputs", "tma", "kv_pages_interleaved", "validate_data"):
            _flag(f"options.{name}", getattr(self, name))
        _positive_int("options.output_qk_max_bytes", self.output_qk_max_bytes)
        if not isinstance(self._tuning, _Tuning):
            raise fail("options._tuning", f"a {type(self._tuning).__name__}", "a cupa.options._Tuning")

    def __repr__(self) -> str:
        default = DEFAULT_OPTIONS if "DEFAULT_OPTIONS" in globals() else None
        parts = []
        for f in fields(self):
            v = getattr(self, f.name)
            if default is None or v != getattr(default, f.name):
                parts.append(f"{f.name}={v!r}")
        return f"Options({', '.join(parts)})"


DEFAULT_OPTIONS = Options()


def resolve(options) -> Options:
    """``options`` itself, :data:`DEFAULT_OPTIONS` for None; anything else is a PagedAttentionError."""
    if options is None:
        return DEFAULT_OPTIONS
    if not isinstance(options, Options):
        raise fail("options", f"a {type(options).__module__}.{type(options).__qualname__}", "a cupa.Options or None")
    return options

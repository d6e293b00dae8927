"""What every CUDA backend shares: the reasons written once, and the shape of a backend.

A backend module defines ``BACKEND``, an instance of a :class:`CudaBackend` subclass, and the
specializations it can launch (``BACKEND.specializations()``, collected by
:func:`cupa.kernels.registry.all_specializations` for the offline compile check). Its
``not_supported_reasons`` starts from :func:`feature_reasons` (the features only some backends
serve, said once for all of them), then adds its own, read from the Problem, the
:class:`cupa.device.DeviceInfo` of the inputs' device and the :class:`cupa.Options` — nothing else.
"""

from __future__ import annotations

from ..contract import Problem
from ..device import DeviceInfo
from ..options import Options

#: Features a fused backend serves only when it says so (``CudaBackend.serves``), and who serves them.
FEATURES = {
    "latent": ("kv_cache_layout='LATENT' (absorbed MLA)", "mla"),
    "bias": ("attention_bias", ("prefill", "general")),
    "output_qk": ("output_qk (qk_output != 0)", ("decode", "general")),
    "return_lse": ("return_lse", None),   # every CUDA backend serves it
    "subbyte": ("packed 4-bit caches (k/v_cache_dtype 'int4', 'float4e2m1')", ("decode", "prefill")),
}


#: Shared memory the driver reserves per resident CTA on compute capability 8.0 and newer (bytes).
CTA_RESERVED_SHARED = 1024


def ctas_per_sm(shared_bytes: int, device: DeviceInfo) -> int:
    """How many CTAs using ``shared_bytes`` of shared memory (static plus dynamic) fit one SM at once."""
    return device.shared_per_sm // (shared_bytes + CTA_RESERVED_SHARED)


def shared_reason(kernel: str, need: int, device: DeviceInfo) -> str:
    """The reason to decline when no variant of ``kernel`` fits the device's shared memory per CTA."""
    return (f"{kernel} needs {need} B of shared memory per CTA; {device.name} allows "
            f"{device.shared_per_block_optin} B")


def features_of(problem: Problem) -> list:
    """The :data:`FEATURES` a call uses."""
    used = []
    if problem.latent:
        used.append("latent")
    if problem.has_bias:
        used.append("bias")
    if problem.attrs.qk_output:
        used.append("output_qk")
    if problem.attrs.return_lse:
        used.append("return_lse")
    if problem.sub_byte:
        used.append("subbyte")
    return used


def feature_reasons(problem: Problem, serves: frozenset) -> list:
    """Why a backend that serves only ``serves`` of :data:`FEATURES` declines ``problem``."""
    reasons = []
    for feature in features_of(problem):
        if feature not in serves:
            what, where = FEATURES[feature]
            if isinstance(where, tuple):
                where = f"{' and '.join(where)} backends serve"
            elif where:
                where = f"{where} backend serves"
            reasons.append(f"{what} is not served here" + (f" (the {where} it)" if where else ""))
    return reasons


#: What a backend may also mark unverified (``CudaBackend.unverified``), beside :data:`FEATURES`: the cache
#: kinds its kernels read, where some of them have not yet passed their GPU tests.
CACHE_KINDS_UNVERIFIABLE = {"cache8": "caches of 8-bit codes (int8, fp8)"}


def unverified_features(problem: Problem, backend) -> list:
    """The features ``problem`` uses (and its cache kind, :data:`CACHE_KINDS_UNVERIFIABLE`) that ``backend``
    serves but has not yet had verified on a GPU (``CudaBackend.unverified``)."""
    used = features_of(problem)
    if problem.quantized and not problem.sub_byte:
        used.append("cache8")
    return [f for f in used if f in backend.unverified]


def describe_unverified(feature: str) -> str:
    """The words explain() uses for an entry of ``CudaBackend.unverified``."""
    return FEATURES[feature][0] if feature in FEATURES else CACHE_KINDS_UNVERIFIABLE[feature]


def packed_cache_reasons(problem: Problem) -> list:
    """Why the kernels reading packed 4-bit caches decline ``problem``: one cache 4-bit and the other not
    (their K and V tiles share one row width)."""
    if problem.sub_byte and not problem.packed:
        a = problem.attrs
        return [f"k_cache_dtype={a.k_cache_dtype!r} with v_cache_dtype={a.v_cache_dtype!r}: the kernels read K and V "
                "rows of one width (two 4-bit kinds, or two 8-bit ones); the NumPy reference serves this pair"]
    return []


class CudaBackend:
    """The shape of a CUDA backend (see :mod:`cupa.dispatch`).

    Attributes
    ----------
    name : str
        The name :class:`cupa.Options` selects it by.
    verified : bool
        Its kernels have passed their GPU tests on a device. An unverified backend is never chosen
        by ``Options(backend="auto")``; ``Options(backend=name)`` runs it.
    serves : frozenset
        The :data:`FEATURES` it serves.
    unverified : frozenset
        The features of ``serves`` (or cache kinds, :data:`CACHE_KINDS_UNVERIFIABLE`) whose kernels have not
        yet passed their GPU tests on a device: a call using one is never given to this backend by
        ``Options(backend="auto")`` (explain() says "not yet verified on a GPU"); ``Options(backend=name)``
        runs it.
    """

    name = ""
    verified = True
    serves = frozenset()
    unverified = frozenset()

    def not_supported_reasons(self, problem: Problem, device: DeviceInfo, options: Options) -> list:
        return feature_reasons(problem, self.serves) + self.reasons(problem, device, options)

    def reasons(self, problem: Problem, device: DeviceInfo, options: Options) -> list:
        """The backend's own reasons to decline (shapes, dtypes, the device's limits)."""
        return []

    def preferred(self, problem: Problem, device: DeviceInfo, options: Options) -> bool:
        return True

    def describe(self, problem: Problem, device: DeviceInfo, options: Options) -> str:
        raise NotImplementedError

    def specializations(self) -> list:
        """Every :class:`cupa.jit.Specialization` this backend can launch."""
        raise NotImplementedError

    def run(self, plan, inputs: dict, out=None, stream=None):
        raise NotImplementedError

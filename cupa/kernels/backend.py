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
    "bias": ("attention_bias", "general"),
    "output_qk": ("output_qk (qk_output != 0)", "general"),
    "return_lse": ("return_lse", None),   # every CUDA backend serves it
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
    return used


def feature_reasons(problem: Problem, serves: frozenset) -> list:
    """Why a backend that serves only ``serves`` of :data:`FEATURES` declines ``problem``."""
    reasons = []
    for feature in features_of(problem):
        if feature not in serves:
            what, where = FEATURES[feature]
            reasons.append(f"{what} is not served here" + (f" (the {where} backend serves it)" if where else ""))
    return reasons


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
    """

    name = ""
    verified = True
    serves = frozenset()

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

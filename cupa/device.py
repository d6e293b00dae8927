"""What backend choice may know about a GPU: :class:`DeviceInfo`, read once per device.

Dispatch reads the description of the device the inputs live on (never the current device), so a
choice made for one GPU is never reused for inputs on another: the plan memo is keyed by device.
:func:`describe_capability` builds the description of a GPU that is not present from a table of
published limits, for explain() and for CPU tests of dispatch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

__all__ = ["DeviceInfo", "device_info", "describe_capability", "SHARED_OPTIN_BY_CAPABILITY"]

#: Opt-in shared memory per block (bytes; static plus dynamic) by compute capability, from the CUDA
#: programming guide's table. At run time the device's own attribute is read instead.
SHARED_OPTIN_BY_CAPABILITY = {
    (8, 0): 166912, (8, 6): 101376, (8, 7): 166912, (8, 9): 101376,
    (9, 0): 232448, (10, 0): 232448, (12, 0): 101376,
}
#: Shared memory per SM (bytes) by compute capability.
SHARED_PER_SM_BY_CAPABILITY = {
    (8, 0): 167936, (8, 6): 102400, (8, 7): 167936, (8, 9): 102400,
    (9, 0): 233472, (10, 0): 233472, (12, 0): 102400,
}
#: SM counts of the common parts, for a description without a device (explain() on a CPU machine).
_SMS_BY_CAPABILITY = {(8, 0): 108, (8, 6): 84, (8, 7): 16, (8, 9): 142, (9, 0): 132, (10, 0): 148, (12, 0): 170}


@dataclass(frozen=True)
class DeviceInfo:
    """A CUDA device as backend choice sees it.

    Attributes
    ----------
    ordinal : int
        CUDA device ordinal (-1 for a description built from a table, :func:`describe_capability`).
    name : str
    capability : (int, int)
        Compute capability (major, minor).
    sm_count : int
        Streaming multiprocessors.
    shared_per_block_optin : int
        Largest shared memory one CTA may use, static plus dynamic, after opting in (bytes).
    shared_per_sm : int
        Shared memory of one SM (bytes): how many CTAs of a kernel fit at once.
    """

    ordinal: int
    name: str
    capability: tuple
    sm_count: int
    shared_per_block_optin: int
    shared_per_sm: int

    @property
    def arch(self) -> str:
        """The real architecture, ``"sm_90"``."""
        return f"sm_{self.capability[0]}{self.capability[1]}"

    def __str__(self) -> str:
        return (f"{self.name} (compute capability {self.capability[0]}.{self.capability[1]}, {self.sm_count} SMs, "
                f"{self.shared_per_block_optin} B shared memory per CTA)")


@functools.lru_cache(maxsize=None)
def device_info(ordinal: int) -> DeviceInfo:
    """The description of CUDA device ``ordinal``, read from the driver once."""
    import cupy

    dev = cupy.cuda.Device(ordinal)
    attrs = dev.attributes
    cc = dev.compute_capability  # "90"
    capability = (int(cc[:-1]), int(cc[-1]))
    try:
        name = cupy.cuda.runtime.getDeviceProperties(ordinal)["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # a partial runtime
        name = f"CUDA device {ordinal}"
    return DeviceInfo(ordinal=ordinal, name=name, capability=capability,
                      sm_count=int(attrs["MultiProcessorCount"]),
                      shared_per_block_optin=int(attrs["MaxSharedMemoryPerBlockOptin"]),
                      shared_per_sm=int(attrs["MaxSharedMemoryPerMultiprocessor"]))


def describe_capability(major: int, minor: int = 0, sm_count: int = None) -> DeviceInfo:
    """A description of a GPU of compute capability ``major.minor`` from the published limits."""
    cc = (int(major), int(minor))
    if cc not in SHARED_OPTIN_BY_CAPABILITY:
        raise ValueError(f"capability: got {cc}; expected one of {sorted(SHARED_OPTIN_BY_CAPABILITY)}")
    return DeviceInfo(ordinal=-1, name=f"a compute capability {cc[0]}.{cc[1]} GPU", capability=cc,
                      sm_count=int(sm_count or _SMS_BY_CAPABILITY[cc]),
                      shared_per_block_optin=SHARED_OPTIN_BY_CAPABILITY[cc],
                      shared_per_sm=SHARED_PER_SM_BY_CAPABILITY[cc])

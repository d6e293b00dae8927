"""Where cupa's CUDA kernels are compiled: sources, specializations, the module cache.

A kernel is named by a :class:`Specialization`: the ``cuda_src`` file it lives in (its *family*),
the C++ name expression that instantiates it (``"paged_decode<__half, 128, 4>"``) and any extra
NVRTC options. Two routes compile one:

- :func:`get_kernel` (the run-time route): ``cupy.RawModule`` on the current device, memoized per
  ``(specialization, device)``. CuPy adds ``-arch=sm_<cc>`` and ``-ftz=true`` and keeps its own disk
  cache, keyed on the ``code=`` string. That is why :func:`source_text` inlines our own headers into
  the code: CuPy does not hash headers reached through ``-I``, so an edited ``.cuh`` would otherwise
  load a stale cubin.
- :func:`compile_offline` (no GPU needed): NVRTC directly, to a cubin for an explicit ``arch``
  (``sm_80``, ``sm_90``, ``sm_90a``...), with ``ptxas -v`` statistics: registers, spills, static
  shared memory. CI runs it for every registered specialization (``python -m cupa.compile --check``).
  Its cubin, loaded with :func:`load_cubin`, is also the route for arch-specific kernels (``sm_90a``:
  wgmma, setmaxnreg) that RawModule cannot target.

Compile and cache events are logged at DEBUG on the ``cupa`` logger.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import importlib.util
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from ._capture import check_compile_allowed

log = logging.getLogger("cupa")

__all__ = [
    "SOURCE_DIR", "COMMON_OPTIONS", "Specialization", "KernelCompileError", "OfflineResult",
    "source_text", "get_kernel", "compile_offline", "load_cubin", "cuda_include_dirs",
]

#: NVRTC options every specialization gets, on both routes. (CuPy adds -arch and -ftz=true itself;
#: compile_offline adds the same two.)
COMMON_OPTIONS: tuple = ("-std=c++17",)


def _find_source_dir() -> Path:
    here = Path(__file__).resolve().parent
    # Installed wheel: site-packages/cupa/cuda_src. Source checkout: repo/cuda_src next to repo/cupa.
    for candidate in (here / "cuda_src", here.parent / "cuda_src"):
        if candidate.is_dir():
            return candidate
    # Editable installs map the package cupa.cuda_src through an import finder.
    try:
        spec = importlib.util.find_spec("cupa.cuda_src")
    except ImportError:
        spec = None
    for location in (spec.submodule_search_locations or []) if spec else []:
        if Path(location).is_dir():
            return Path(location)
    return here / "cuda_src"  # absent: source_text() raises naming this path


#: The directory holding the ``.cu`` kernel families and their ``.cuh`` headers.
SOURCE_DIR: Path = _find_source_dir()

_QUOTED_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[^\n]*$', re.MULTILINE)
_PRAGMA_ONCE = re.compile(r"^[ \t]*#[ \t]*pragma[ \t]+once[^\n]*$", re.MULTILINE)


def source_text(filename: str, source_dir: Union[str, Path, None] = None) -> str:
    """The text of ``filename`` with our own quoted headers inlined, recursively.

    Every ``#include "x.cuh"`` is replaced by the header's text (each header once, however often it
    is included; ``#pragma once`` dropped), framed by ``#line`` directives so NVRTC messages still
    name the original file and line. System includes (``#include <cuda_fp16.h>``) are left alone.
    The result is what goes into ``code=``, so CuPy's cache key covers every edited header.

    Parameters
    ----------
    filename : str
        A file of ``source_dir`` (``"decode.cu"``) or an absolute path.
    source_dir : path, optional
        Where quoted includes are looked up; default :data:`SOURCE_DIR`.
    """
    root = Path(source_dir) if source_dir is not None else SOURCE_DIR
    path = Path(filename) if Path(filename).is_absolute() else root / filename
    if not path.is_file():
        raise FileNotFoundError(f"cupa kernel source {path} not found (cupa looks for CUDA sources in {root})")
    seen: set = set()

    def expand(p: Path, stack: tuple) -> str:
        text = p.read_text()
        out, pos = [], 0
        for m in _QUOTED_INCLUDE.finditer(text):
            out.append(text[pos:m.start()])
            pos = m.end()
            line = text.count("\n", 0, m.start()) + 1
            target = (p.parent / m.group(1)).resolve()
            if not target.is_file():
                target = (root / m.group(1)).resolve()
            if not target.is_file():
                raise FileNotFoundError(f'{p.name}:{line}: #include "{m.group(1)}" not found next to {p.name} '
                                        f"or in {root}")
            if target in stack:
                raise ValueError(f'{p.name}:{line}: #include "{m.group(1)}" is circular '
                                 f"({' -> '.join(s.name for s in stack + (target,))})")
            if target in seen:
                out.append(f"// (already inlined) #include \"{m.group(1)}\"")
                continue
            seen.add(target)
            body = _PRAGMA_ONCE.sub("", expand(target, stack + (target,)))
            out.append(f'#line 1 "{target.name}"\n{body}\n#line {line + 1} "{p.name}"')
        out.append(text[pos:])
        return "".join(out)

    top = path.resolve()
    return expand(top, (top,))


@dataclass(frozen=True)
class Specialization:
    """One compiled kernel: a family (``cuda_src/<family>.cu``) and a template instantiation.

    Parameters
    ----------
    family : str
        The ``.cu`` file stem, e.g. ``"decode"``.
    name_expression : str
        The C++ expression naming the kernel, e.g. ``"paged_decode<__half, 128, 4>"``.
    options : tuple of str
        Extra NVRTC options (``-D...``, ``-maxrregcount=...``), after :data:`COMMON_OPTIONS`. The
        architecture is not one of them: RawModule picks the device's, compile_offline takes ``arch``.
    arch : str
        Empty for portable kernels. An arch-specific target (``"sm_90a"``: wgmma, setmaxnreg) pins
        the kernel to it: :func:`get_kernel` then compiles it offline for that arch (cached on
        disk, see :func:`get_kernel`) instead of through RawModule, and ``python -m cupa.compile``
        compiles it for that arch only, whenever an architecture of the same number is checked.
    """

    family: str
    name_expression: str
    options: tuple = field(default=())
    arch: str = ""

    def __post_init__(self):
        if not self.family or "/" in self.family or self.family.endswith(".cu"):
            raise ValueError(f"Specialization.family: got {self.family!r}; expected a cuda_src/*.cu file stem")
        if not self.name_expression:
            raise ValueError("Specialization.name_expression: got an empty string; expected a kernel name expression")
        object.__setattr__(self, "options", tuple(self.options))
        arch = [o for o in self.options if o.startswith(("-arch", "--gpu-architecture"))]
        if arch:
            raise ValueError(f"Specialization.options: got {arch}; the architecture is chosen by the route "
                             "(the device for get_kernel, the arch argument for compile_offline)")
        if self.arch and not re.fullmatch(r"sm_\d+[af]", self.arch):
            raise ValueError(f"Specialization.arch: got {self.arch!r}; expected '' or an arch-specific target "
                             "like 'sm_90a'")

    @property
    def filename(self) -> str:
        return f"{self.family}.cu"

    def __str__(self) -> str:
        extra = f" [{' '.join(self.options)}]" if self.options else ""
        pinned = f" @{self.arch}" if self.arch else ""
        return f"{self.family}:{self.name_expression}{extra}{pinned}"


class KernelCompileError(RuntimeError):
    """NVRTC rejected a specialization. ``log`` holds NVRTC's log; ``name_expression`` the kernel."""

    def __init__(self, spec: Specialization, log_text: str, arch: str = ""):
        self.spec = spec
        self.name_expression = spec.name_expression
        self.log = log_text
        self.arch = arch
        where = f" for {arch}" if arch else ""
        super().__init__(f"cupa: NVRTC failed to compile {spec.name_expression} ({spec.filename}){where}:\n{log_text}")


# -- the run-time route: RawModule per (specialization, device) -------------------------------------

_modules: dict = {}
_modules_lock = threading.Lock()
_cupy = None


def _cupy_module():
    global _cupy
    if _cupy is None:
        import cupy

        _cupy = cupy
    return _cupy


def get_kernel(spec: Specialization):
    """The compiled kernel of ``spec`` on the current CuPy device (a ``cupy.RawKernel``).

    Compiled once per ``(spec, device)`` and memoized (thread-safe); CuPy's disk cache makes a
    later process skip NVRTC. Raises :class:`KernelCompileError` with NVRTC's log on failure, and
    ``cupa.graphs.GraphCaptureError`` instead of compiling while a CUDA-graph capture is active.

    A specialization pinned to an arch-specific target (``spec.arch``, e.g. ``"sm_90a"``) is compiled
    with :func:`compile_offline` for that arch and loaded with :func:`load_cubin`; its cubin and
    lowered name are cached under ``$CUPA_CACHE_DIR/cubin`` keyed on a hash of the inlined source,
    the options, the arch and the NVRTC version (so an edited header never loads a stale cubin).
    The caller checks that the device runs that arch.
    """
    cupy = _cupy_module()
    device_id = cupy.cuda.runtime.getDevice()
    key = (spec, device_id)
    kernel = _modules.get(key)
    if kernel is not None:
        return kernel
    check_compile_allowed(spec)  # no compile (or module load) inside a CUDA-graph capture
    with _modules_lock:
        kernel = _modules.get(key)
        if kernel is not None:
            return kernel
        if spec.arch:
            kernel = _pinned_kernel(spec)
            _modules[key] = kernel
            return kernel
        code = source_text(spec.filename)
        options = COMMON_OPTIONS + spec.options
        log.debug("cupa: compiling %s on device %d (options %s)", spec, device_id, " ".join(options))
        start = time.perf_counter()
        module = cupy.RawModule(code=code, options=options, name_expressions=[spec.name_expression])
        try:
            kernel = module.get_function(spec.name_expression)
        except cupy.cuda.compiler.CompileException as exc:
            raise KernelCompileError(spec, exc.get_message()) from None
        log.debug("cupa: %s ready on device %d in %.3f s (NVRTC or CuPy's disk cache)",
                  spec, device_id, time.perf_counter() - start)
        _modules[key] = kernel
        return kernel


def _cache_dir() -> Path:
    return Path(os.environ.get("CUPA_CACHE_DIR") or Path.home() / ".cache" / "cupa") / "cubin"


def pinned_cache_key(spec: Specialization) -> str:
    """The disk-cache key of a pinned specialization's cubin: source, options, arch, NVRTC version."""
    h = hashlib.sha256()
    for part in (source_text(spec.filename), "\0".join(offline_options(spec, spec.arch)), spec.name_expression,
                 spec.arch, repr(nvrtc_version())):
        h.update(part.encode())
        h.update(b"\x01")
    return h.hexdigest()[:32]


def _pinned_kernel(spec: Specialization):
    """Compile (or fetch from the disk cache) a pinned specialization's cubin and load it."""
    cache = _cache_dir()
    key = pinned_cache_key(spec)
    path, name_path = cache / f"{key}.cubin", cache / f"{key}.name"
    if not (path.is_file() and name_path.is_file()):
        start = time.perf_counter()
        r = compile_offline(spec, spec.arch, keep_cubin=True)
        if not r.ok:
            raise KernelCompileError(spec, r.log, spec.arch)
        log.debug("cupa: compiled %s for %s in %.3f s", spec, spec.arch, time.perf_counter() - start)
        cache.mkdir(parents=True, exist_ok=True)
        for target, data in ((path, r.cubin), (name_path, r.lowered_name.encode())):
            tmp = target.with_suffix(f"{target.suffix}.{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, target)
    else:
        log.debug("cupa: %s for %s from the cubin cache (%s)", spec, spec.arch, path)
    return load_cubin(path, name_path.read_text())


def load_cubin(cubin: Union[str, Path, bytes], kernel_name: str):
    """Load a kernel from a cubin (a path, or bytes from :func:`compile_offline`) as a ``cupy.RawKernel``.

    ``kernel_name`` is the lowered (mangled) name: ``OfflineResult.lowered_name``. Bytes are written
    once to a content-addressed file under ``$CUPA_CACHE_DIR`` (default ``~/.cache/cupa``) because
    ``cupy.RawModule`` loads from a path.
    """
    cupy = _cupy_module()
    if isinstance(cubin, (bytes, bytearray)):
        digest = hashlib.sha256(cubin).hexdigest()[:32]
        cache = _cache_dir()
        cache.mkdir(parents=True, exist_ok=True)
        path = cache / f"{digest}.cubin"
        if not path.is_file():
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(bytes(cubin))
            os.replace(tmp, path)
        log.debug("cupa: loading cubin %s (%s)", path, kernel_name)
    else:
        path = Path(cubin)
    return cupy.RawModule(path=str(path)).get_function(kernel_name)


# -- the offline route: NVRTC without a GPU ----------------------------------------------------------

def _nvrtc():
    """The NVRTC binding: CuPy's (``cupy_backends``, present wherever CuPy is installed)."""
    from cupy_backends.cuda.libs import nvrtc

    return nvrtc


def nvrtc_version() -> tuple:
    return tuple(_nvrtc().getVersion())


def _site_dirs() -> list:
    import site
    import sys

    dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    dirs += [site.getusersitepackages()] if hasattr(site, "getusersitepackages") else []
    dirs += [p for p in sys.path if p.endswith("site-packages")]
    return list(dict.fromkeys(dirs))


@functools.lru_cache(maxsize=None)
def cuda_include_dirs() -> tuple:
    """Include directories for an offline NVRTC compile: the CUDA headers first, then CCCL.

    CUDA headers (``cuda_fp16.h``...), the first found of: ``$CUPA_CUDA_INCLUDE``; the
    ``nvidia-cuda-runtime`` pip package (``nvidia/cu13/include``, CUDA 12's
    ``nvidia/cuda_runtime/include``), through ``cuda.pathfinder`` when installed; ``$CUDA_PATH`` /
    ``$CUDA_HOME``; ``/usr/local/cuda``. Pip headers come first because they match the pip NVRTC.
    CCCL (``cuda/std/...``): CuPy's bundled copy, as RawModule passes it.
    """
    def has_headers(d) -> bool:
        return d is not None and os.path.isfile(os.path.join(d, "cuda_fp16.h"))

    candidates = [os.environ.get("CUPA_CUDA_INCLUDE")]
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        candidates.append(find_nvidia_header_directory("cudart"))
    except Exception:  # not installed, or nothing found
        pass
    for site_dir in _site_dirs():
        candidates += sorted(glob.glob(os.path.join(site_dir, "nvidia", "cu[0-9]*", "include")), reverse=True)
        candidates.append(os.path.join(site_dir, "nvidia", "cuda_runtime", "include"))
    for var in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "include"))
    candidates.append("/usr/local/cuda/include")
    cuda = next((d for d in candidates if has_headers(d)), None)
    if cuda is None:
        raise FileNotFoundError("cupa: no CUDA headers (cuda_fp16.h) found; install nvidia-cuda-runtime "
                                "(pip), set CUDA_PATH, or set CUPA_CUDA_INCLUDE to a CUDA include directory")
    dirs = [cuda]
    spec = importlib.util.find_spec("cupy")
    if spec is not None and spec.origin:
        cccl = os.path.join(os.path.dirname(spec.origin), "_core", "include", "cupy", "_cccl")
        dirs += [os.path.join(cccl, sub) for sub in ("libcudacxx", "cub", "thrust")
                 if os.path.isdir(os.path.join(cccl, sub))]
    return tuple(dirs)


@dataclass(frozen=True)
class OfflineResult:
    """The outcome of one offline compile: ptxas statistics of the kernel, or NVRTC's log.

    ``registers`` per thread, ``spill_store_bytes`` / ``spill_load_bytes`` and ``stack_bytes``
    per thread, ``shared_bytes`` of static shared memory (dynamic shared memory is a launch
    parameter). All -1 when ``ok`` is False, or when NVRTC compiled from the CUDA compute cache and
    ptxas printed nothing (``has_stats`` False). ``cubin`` is kept only when asked for.
    """

    spec: Specialization
    arch: str
    ok: bool
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    shared_bytes: int
    stack_bytes: int
    log: str
    seconds: float
    lowered_name: str = ""
    cubin: Optional[bytes] = field(default=None, repr=False)

    @property
    def spills(self) -> bool:
        return self.spill_store_bytes > 0 or self.spill_load_bytes > 0

    @property
    def has_stats(self) -> bool:
        """False when NVRTC compiled but ptxas printed no statistics (a compute-cache hit)."""
        return self.registers >= 0

    def summary(self) -> str:
        if not self.ok:
            return f"FAIL {self.arch:<7} {self.spec}  ({self.seconds:.1f} s)"
        if not self.has_stats:
            return f"ok   {self.arch:<7} {self.spec}  (no ptxas statistics: compute-cache hit)  {self.seconds:.1f} s"
        return (f"ok   {self.arch:<7} {self.spec}  regs {self.registers:>3}  "
                f"spill {self.spill_store_bytes}/{self.spill_load_bytes} B  smem {self.shared_bytes} B  "
                f"stack {self.stack_bytes} B  {self.seconds:.1f} s")


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas_log(text: str) -> dict:
    """``{mangled kernel name: {registers, spill_store_bytes, spill_load_bytes, stack_bytes, shared_bytes}}``."""
    stats: dict = {}
    current = None
    for line in text.splitlines():
        m = _ENTRY.search(line)
        if m:
            current = stats.setdefault(m.group(1), dict(registers=0, spill_store_bytes=0, spill_load_bytes=0,
                                                         stack_bytes=0, shared_bytes=0))
            continue
        if current is None:
            continue
        m = _FRAME.search(line)
        if m:
            current.update(stack_bytes=int(m.group(1)), spill_store_bytes=int(m.group(2)),
                           spill_load_bytes=int(m.group(3)))
        m = _REGS.search(line)
        if m:
            current["registers"] = int(m.group(1))
            s = _SMEM.search(line)
            current["shared_bytes"] = int(s.group(1)) if s else 0
    return stats


def offline_options(spec: Specialization, arch: str) -> list:
    """The NVRTC options of an offline compile: those of the run-time route plus ``-arch`` and ``-v``."""
    if not re.fullmatch(r"sm_\d+[af]?", arch):
        raise ValueError(f"arch: got {arch!r}; expected a real architecture like 'sm_80', 'sm_90' or 'sm_90a'")
    return ([f"-arch={arch}", *COMMON_OPTIONS, "-ftz=true", "--ptxas-options=-v"]
            + [f"-I{d}" for d in cuda_include_dirs()] + list(spec.options))


def compile_offline(spec: Specialization, arch: str = "sm_90", *, keep_cubin: bool = False,
                    source_dir: Union[str, Path, None] = None) -> OfflineResult:
    """Compile ``spec`` to a cubin for ``arch`` with NVRTC, without a GPU; never raises for a compile error.

    Parameters
    ----------
    spec : Specialization
    arch : str
        A real architecture: ``"sm_80"``, ``"sm_90"``, ``"sm_90a"`` (wgmma, setmaxnreg)...
    keep_cubin : bool
        Keep the cubin in the result (for :func:`load_cubin`).
    source_dir : path, optional
        Where the family's ``.cu`` file and its headers live; default :data:`SOURCE_DIR`.

    Returns
    -------
    OfflineResult
        ``ok`` False (with NVRTC's log) when NVRTC rejects the code.
    """
    options = offline_options(spec, arch)
    nvrtc = _nvrtc()
    code = source_text(spec.filename, source_dir)
    start = time.perf_counter()
    prog = nvrtc.createProgram(code, spec.filename, [], [])
    try:
        nvrtc.addNameExpression(prog, spec.name_expression)
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError:
            seconds = time.perf_counter() - start
            text = nvrtc.getProgramLog(prog)
            log.debug("cupa: offline compile of %s for %s failed in %.2f s", spec, arch, seconds)
            return OfflineResult(spec, arch, False, -1, -1, -1, -1, -1, text, seconds)
        seconds = time.perf_counter() - start
        text = nvrtc.getProgramLog(prog)
        lowered = nvrtc.getLoweredName(prog, spec.name_expression)
        cubin = bytes(nvrtc.getCUBIN(prog)) if keep_cubin else None
    finally:
        nvrtc.destroyProgram(prog)
    mine = parse_ptxas_log(text).get(lowered)
    if mine is None:
        # Compiled, but no statistics: with a driver installed, NVRTC 13.0 serves a repeated compile
        # from the CUDA compute cache (~/.nv/ComputeCache) and ptxas prints nothing.
        note = (f"cupa: no ptxas statistics for {lowered} in the NVRTC log; the CUDA compute cache probably "
                "answered (set CUDA_CACHE_DISABLE=1 before NVRTC loads, as `python -m cupa.compile` does)")
        return OfflineResult(spec, arch, True, -1, -1, -1, -1, -1, f"{note}\n{text}", seconds, lowered, cubin)
    log.debug("cupa: offline compile of %s for %s in %.2f s: %s", spec, arch, seconds, mine)
    return OfflineResult(spec, arch, True, mine["registers"], mine["spill_store_bytes"], mine["spill_load_bytes"],
                         mine["shared_bytes"], mine["stack_bytes"], text, seconds, lowered, cubin)

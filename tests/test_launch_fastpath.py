"""The host-side launch path of the CUDA decode backend, without a GPU (a fake CuPy) and on one.

CPU tests run the whole call path (``cupa.PagedAttention(...)(cupy arrays)``) against :class:`FakeCupy`,
a stand-in for the few CuPy entry points cupa touches. Its kernels know their C signatures (parsed
from ``cuda_src/*.cu``): every launch, by either route, is decoded into the bytes each parameter
receives, and a parameter of the wrong size (an ``int64`` where the kernel takes ``int``) fails. The
fast route (``cuLaunchKernel`` with a prebuilt parameter array) must hand every kernel exactly the
bytes the ``RawKernel.__call__`` route (``cupa.Options(launch="rawkernel")``) hands it.

The ``gpu`` tests compare the two routes bit for bit on the device (decode- and prefill-shaped,
quantized, with and without ``out=``, and under CUDA-graph capture).

``benchmarks/host_overhead_cpu.py`` reuses :class:`FakeCupy` to time the Python side of one call.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import math
import pickle
import re
import sys
import threading
import time
import types

import numpy as np
import pytest

import cupa
from cupa import _capture, arrays, device, graphs, jit
from cupa.kernels import launch

# -- a fake CuPy ---------------------------------------------------------------------------------------

_SIG = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\(([^{]*?)\)\s*\{", re.S)


def kernel_signatures() -> dict:
    """``{kernel name: parameter sizes in bytes}`` parsed from cuda_src/*.cu (None where a type is unknown)."""
    sigs = {}
    for path in sorted(jit.SOURCE_DIR.glob("*.cu")):
        text = re.sub(r"//[^\n]*", "", path.read_text())
        for m in _SIG.finditer(text):
            sizes = []
            for param in m.group(2).split(","):
                param = " ".join(param.split())
                if re.match(r"const __grid_constant__ TmaMap\b", param):
                    sizes.append(launch.TENSOR_MAP_BYTES)  # a tensor map, by value
                elif "*" in param:
                    sizes.append(8)
                elif re.match(r"(const )?(long long|int64_t|uint64_t|size_t|double|unsigned long long)\b", param):
                    sizes.append(8)
                elif re.match(r"(const )?(int|unsigned|uint32_t|int32_t|float)\b", param):
                    sizes.append(4)
                else:
                    sizes = None
                    break
            sigs[m.group(1)] = None if sizes is None else tuple(sizes)
    return sigs


class _MemoryPointer:
    __slots__ = ("ptr", "device_id", "size", "__weakref__")

    def __init__(self, ptr, device_id, size):
        self.ptr, self.device_id, self.size = ptr, device_id, size


class _Flags:
    c_contiguous = True


class FakeCupy:
    """Enough of CuPy for cupa's CUDA call path; launches are recorded as the bytes each parameter gets.

    ``launches``: ``(route, kernel name, grid, block, shared_mem, stream, tuple of bytes per parameter)``;
    ``allocations``: byte counts of every device allocation (``empty`` and ``cuda.alloc``).
    Set ``record = False`` to time the Python side without the decoding.
    """

    def __init__(self, device_count: int = 1, sm_count: int = 132, real_arrays: bool = False):
        fake = self
        self.sigs = kernel_signatures()
        self.launches, self.allocations = [], []
        self.record = True
        self.switch_in_launch = False
        self.compiled = []
        self._next = itertools.count(1)
        self._heap = [0x7F00_0000_0000]
        self._functions = {}
        self._tls = threading.local()
        self.mem_get_info_calls = 0

        class ndarray:
            __module__ = "cupy._core.core"

            def __init__(self, shape, dtype=np.float32, memptr=None):
                self.shape = tuple(int(d) for d in shape)
                self.dtype = np.dtype(dtype)
                self.size = int(np.prod(self.shape, dtype=np.int64))
                self.nbytes = self.size * self.dtype.itemsize
                self.ndim = len(self.shape)
                self.flags = _Flags
                self._c_contiguous = True
                self.data = memptr if memptr is not None else fake._malloc(self.nbytes)

        self.ndarray = ndarray
        self._real = None
        if real_arrays:  # real cupy.ndarray objects over fake addresses: CuPy's own attribute costs
            import cupy as real

            self.ndarray, self._real = real.ndarray, real
        self.float32, self.float16, self.int32, self.uint8 = np.float32, np.float16, np.int32, np.uint8

        class _BaseStream:
            def __init__(self, ptr):
                self.ptr = ptr

            def __enter__(self):
                fake._stack().append(self)
                return self

            def __exit__(self, *exc):
                fake._stack().pop()

            def is_capturing(self):
                return False

        class Stream(_BaseStream):
            def __init__(self, non_blocking=False):
                super().__init__(0x5000 + next(fake._next))

        Stream.null = _BaseStream(0)
        self._null = Stream.null

        class Device:
            def __init__(self, device=None):
                self.id = fake._device() if device is None else int(device)
                self.attributes = {"MultiProcessorCount": sm_count, "MaxSharedMemoryPerBlockOptin": 232448,
                                   "MaxSharedMemoryPerMultiprocessor": 233472}
                self.compute_capability = "90"

            def __enter__(self):
                self._prev = fake._device()
                fake._tls.device = self.id
                return self

            def __exit__(self, *exc):
                fake._tls.device = self._prev

        class Function:
            def __init__(self, ptr):
                self.ptr = ptr

        class CPointer:  # cupy.cuda.function.CPointer: an argument passed as the bytes at an address
            def __init__(self, p=0):
                self.ptr = p

        class RawKernel:
            def __init__(self, name):
                self.name = name
                self.kernel = Function(0xF000 + next(fake._next))
                fake._functions[self.kernel.ptr] = name
                self.max_dynamic_shared_size_bytes = 0

            def __call__(self, grid, block, args, shared_mem=0):
                if not fake.record:
                    fake.launches.append(None)
                    return
                fake._record("rawkernel", self.name, grid, block, shared_mem, fake.get_current_stream().ptr,
                             [fake._arg_bytes(a) for a in args])

        class RawModule:
            def __init__(self, code=None, options=(), name_expressions=()):
                fake.compiled.append(tuple(name_expressions))

            def get_function(self, name_expression):
                return RawKernel(name_expression.split("<")[0])

        class CompileException(Exception):
            pass

        def launch_kernel(f, gx, gy, gz, bx, by, bz, shared, stream, kernel_params, extra):
            assert extra == 0 and kernel_params != 0
            if fake.switch_in_launch:
                time.sleep(0)         # the GIL is released in cuLaunchKernel: let other threads run here
            name = fake._functions[f]
            if not fake.record:
                fake.launches.append(None)
                return
            sizes = fake.sigs[name]
            table = (ctypes.c_uint64 * len(sizes)).from_address(kernel_params)
            fake._record("fast", name, (gx, gy, gz), (bx, by, bz), shared, stream,
                         [ctypes.string_at(table[i], n) for i, n in enumerate(sizes)])

        def mem_get_info():
            fake.mem_get_info_calls += 1
            return (1 << 30, 1 << 31)

        self.RawModule = RawModule
        runtime = types.SimpleNamespace(getDevice=self._device, getDeviceCount=lambda: device_count,
                                        memGetInfo=mem_get_info,
                                        getDeviceProperties=lambda d: {"name": b"Fake H200"})
        driver = types.SimpleNamespace(launchKernel=launch_kernel, ctxGetCurrent=lambda: 0xC0)
        self.cuda = types.SimpleNamespace(
            Device=Device, Stream=Stream, runtime=runtime, driver=driver,
            stream=types.SimpleNamespace(_BaseStream=_BaseStream),
            get_current_stream=self.get_current_stream, alloc=self._alloc,
            function=types.SimpleNamespace(CPointer=CPointer),
            compiler=types.SimpleNamespace(CompileException=CompileException),
            is_available=lambda: True)

    # -- state ----------------------------------------------------------------------------------------
    def _device(self):
        return getattr(self._tls, "device", 0)

    def _stack(self):
        s = getattr(self._tls, "streams", None)
        if s is None:
            s = self._tls.streams = []
        return s

    def get_current_stream(self):
        s = self._stack()
        return s[-1] if s else self._null

    def _malloc(self, nbytes):
        ptr = self._heap[0]
        self._heap[0] += max(512, -(-nbytes // 512) * 512)
        self.allocations.append(nbytes)
        return _MemoryPointer(ptr, self._device(), nbytes)

    def _alloc(self, nbytes):
        mp = self._malloc(nbytes)
        if self._real is None:
            return mp
        mem = self._real.cuda.memory.UnownedMemory(mp.ptr, max(nbytes, 1), None, mp.device_id)
        return self._real.cuda.MemoryPointer(mem, 0)

    def empty(self, shape, dtype=np.float32):
        if isinstance(shape, int):
            shape = (shape,)
        if self._real is None:
            return self.ndarray(shape, dtype)
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        return self._real.ndarray(shape, dtype, memptr=self._alloc(nbytes))

    def asarray(self, a):
        a = np.asarray(a)
        return self.ndarray(a.shape, a.dtype)

    # -- launches -------------------------------------------------------------------------------------
    def _arg_bytes(self, a):
        """What CuPy's RawKernel passes for one argument."""
        if a is None:
            return (0).to_bytes(8, "little")
        if isinstance(a, self.ndarray):
            return a.data.ptr.to_bytes(8, "little")
        if isinstance(a, bool):
            raise TypeError("a Python bool kernel argument")
        if isinstance(a, int):
            return np.int64(a).tobytes()           # CuPy: a Python int is a long long
        if isinstance(a, float):
            return np.float64(a).tobytes()
        if isinstance(a, np.generic):
            return a.tobytes()
        if isinstance(a, self.cuda.function.CPointer):
            return ctypes.string_at(a.ptr, launch.TENSOR_MAP_BYTES)  # (the only CPointer arguments: tensor maps)
        raise TypeError(f"unsupported kernel argument {type(a)}")

    def _record(self, route, name, grid, block, shared, stream, params):
        if not self.record:
            self.launches.append(None)
            return
        grid = tuple(grid) + (1,) * (3 - len(grid))
        block = tuple(block) + (1,) * (3 - len(block))
        sizes = self.sigs[name]
        got = tuple(len(p) for p in params)
        if got != sizes:
            raise AssertionError(f"{route} launch of {name}: parameter sizes {got}, the kernel takes {sizes}")
        self.launches.append((route, name, grid, block, int(shared), int(stream), tuple(params)))


@contextlib.contextmanager
def fake_cupy(fake: FakeCupy | None = None):
    """Install ``fake`` as ``cupy`` for cupa (module caches included)."""
    fake = fake or FakeCupy()
    saved_module = sys.modules.get("cupy")
    saved = (arrays._cupy, jit._cupy, dict(jit._modules), None,
             dict(launch._SHARED_CONFIGURED), dict(arrays._STREAMS))
    sys.modules["cupy"] = fake
    arrays._cupy = jit._cupy = None
    jit._modules.clear()
    launch._SHARED_CONFIGURED.clear()
    device.device_info.cache_clear()
    launch._reset_module_cache()
    try:
        yield fake
    finally:
        if saved_module is None:
            sys.modules.pop("cupy", None)
        else:
            sys.modules["cupy"] = saved_module
        arrays._cupy, jit._cupy = saved[0], saved[1]
        jit._modules.clear()
        jit._modules.update(saved[2])
        launch._SHARED_CONFIGURED.clear()
        launch._SHARED_CONFIGURED.update(saved[4])
        arrays._STREAMS.clear()
        arrays._STREAMS.update(saved[5])
        device.device_info.cache_clear()
        launch._reset_module_cache()


def fake_case(fake: FakeCupy, *, B=1, L=16, H=32, Hk=8, D=128, bs=16, N=None, dtype=np.float16, cache=None,
              quant=None, rotary=False, sink=False, qk_norm=False, slot_mapping=False, positions=False,
              packed=False):
    """Fake device inputs (shapes and dtypes only) and attributes of one problem."""
    N = B if N is None else N
    mb = -(-L // bs) * 2
    nb = B * mb
    e = fake.empty
    x = {"query": e((N, (H + 2 * Hk) * D if packed else H * D), dtype)}
    if not packed:
        x["key"], x["value"] = e((N, Hk * D), dtype), e((N, Hk * D), dtype)
    cdt = dtype if cache is None else {"int8": np.int8, "fp8": np.uint8}[cache]
    x["key_cache"], x["value_cache"] = e((nb, bs, Hk, D), cdt), e((nb, bs, Hk, D), cdt)
    x["cumulative_sequence_length"] = e((B + 1,), np.int32)
    x["past_seqlens"] = e((B,), np.int32)
    x["block_table"] = e((B, mb), np.int32)
    attrs = dict(num_heads=H, kv_num_heads=Hk)
    if cache is not None:
        q = quant or "PER_CHANNEL"
        shape = (1,) if q == "PER_TENSOR" else (Hk, 1, D)
        x["k_scale"], x["v_scale"] = e(shape, np.float32), e(shape, np.float32)
        attrs.update(k_quant_type=q, v_quant_type=q)
        if cache == "fp8":
            attrs.update(k_cache_dtype="float8e4m3fn", v_cache_dtype="float8e4m3fn")
    if rotary:
        x["cos_cache"], x["sin_cache"] = e((L + N + 8, D // 2), dtype), e((L + N + 8, D // 2), dtype)
        attrs.update(do_rotary=1)
    if sink:
        x["head_sink"] = e((H,), dtype)
    if qk_norm:
        x["q_norm_weight"], x["k_norm_weight"] = e((D,), dtype), e((D,), dtype)
    if slot_mapping:
        x["slot_mapping"] = e((N,), np.int32)
    if positions:
        x["query_positions"] = e((N,), np.int32)
    return x, attrs


CASES = {
    "decode_gqa_fp16": dict(B=1, L=16),
    "decode_b8_long_split": dict(B=8, L=4096),
    "decode_b8_long_split_rotary": dict(B=8, L=4096, rotary=True),
    "decode_fp32_cuda_cores": dict(B=3, L=700, D=64, dtype=np.float32, H=8, Hk=2),
    "int8_per_tensor": dict(B=2, L=3000, cache="int8", quant="PER_TENSOR"),
    "fp8_per_channel_features": dict(B=2, L=900, cache="fp8", rotary=True, sink=True, qk_norm=True,
                                     slot_mapping=True, positions=True),
    "prefill_shaped_packed": dict(B=2, N=40, L=512, packed=True, H=8, Hk=8, D=64, rotary=True),
    "bf16_mha_d256": dict(B=2, L=300, D=256, H=4, Hk=4, dtype="bfloat16"),
}


def _np_dtype(d):
    if d == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return d


def _run(fake, case, *, out=False, md=None, calls=1, options=None):
    """Run ``case`` ``calls`` times through a bound op with ``options``."""
    kw = dict(CASES[case])
    kw["dtype"] = _np_dtype(kw.get("dtype", np.float16))
    x, attrs = fake_case(fake, **kw)
    op = cupa.PagedAttention(**attrs, options=options)
    o = fake.empty(x["query"].shape[:1] + (attrs["num_heads"] * x["key_cache"].shape[-1],), x["query"].dtype) \
        if out else None
    results = [op(**x, attention_metadata=md, out=o) for _ in range(calls)]
    return x, o, results


_OURS = ("paged_prologue", "paged_decode", "paged_decode_mma")


# -- CPU tests ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("out", [False, True])
@pytest.mark.parametrize("via", ["op", "decode_backend"])
@pytest.mark.parametrize("real_arrays", [False, True])
def test_fast_route_passes_the_bytes_rawkernel_passes(case, out, via, real_arrays):
    """Same kernels, grids, blocks, shared memory, stream and parameter bytes on both routes."""
    if real_arrays:
        pytest.importorskip("cupy")
    seen = {}
    for mode in ("rawkernel", "fast"):
        fake = FakeCupy(real_arrays=real_arrays)
        options = cupa.Options(launch=mode, backend="decode" if via == "decode_backend" else "auto")
        with fake_cupy(fake):
            fake._heap[0] = 0x7F00_0000_0000          # same addresses in both runs
            _run(fake, case, out=out, md=[1, 0] if case.startswith("decode_b8") else None, calls=2,
                 options=options)
        ours = [launch_ for launch_ in fake.launches if launch_[1] in _OURS]
        assert ours and all(launch_[0] == mode for launch_ in ours)
        seen[mode] = ([launch_[1:] for launch_ in fake.launches], fake.allocations)
    assert seen["fast"] == seen["rawkernel"]


def test_tensor_map_arguments_reach_the_kernel_on_both_routes():
    """TENSOR_MAP arguments: 128 bytes given at each launch, in order, by value, on both routes (a kernel
    taking a pointer, a map, an int and another map)."""
    seen = {}
    for mode in ("rawkernel", "fast"):
        fake = FakeCupy()
        fake.sigs["k_maps"] = (8, 128, 4, 128)
        with fake_cupy(fake):
            kernel = fake.RawModule().get_function("k_maps<1>")
            step = launch.Launcher(kernel, (3,), (32,), (launch.POINTER, launch.TENSOR_MAP, np.int32(7),
                                                         launch.TENSOR_MAP))
            seq = launch.Sequence([(step, (0,))], 1, route=mode)
            for call in range(2):
                maps = (bytes(range(call, call + 128)), bytes(range(255 - call, 127 - call, -1)))
                seq([0x1000 + call], 0, maps)
                with pytest.raises(ValueError):
                    seq([0x1000], 0, maps[:1])
        seen[mode] = [launch_[1:] for launch_ in fake.launches]
        for call, launch_ in enumerate(fake.launches):
            params = launch_[-1]
            assert params == ((0x1000 + call).to_bytes(8, "little"), bytes(range(call, call + 128)),
                              np.int32(7).tobytes(), bytes(range(255 - call, 127 - call, -1)))
    assert seen["fast"] == seen["rawkernel"] and len(seen["fast"]) == 2


@pytest.mark.parametrize("case", ["decode_b8_long_split", "decode_gqa_fp16", "decode_fp32_cuda_cores",
                                  "prefill_shaped_packed"])
def test_programmatic_launch_of_the_decode_kernel(monkeypatch, case):
    """With programmatic dependent launch on, the attention kernel (decode, or prefill for a
    prefill-shaped call) goes through cuLaunchKernelEx with the PROGRAMMATIC_STREAM_SERIALIZATION
    attribute and the very bytes of the plain launch; the prologue keeps the plain launch."""
    from cupa.kernels import launch

    seen, ex_calls = {}, []
    for pdl in (False, True):
        fake = FakeCupy()

        def fake_ex(cfg_ptr, func, table, extra, fake=fake):
            cfg = launch.driver.LaunchConfig.from_address(cfg_ptr)
            attrs = [(cfg.attrs[i].id, cfg.attrs[i].value[0]) for i in range(cfg.numAttrs)]
            ex_calls.append((fake._functions[func], attrs))
            assert extra is None
            fake.cuda.driver.launchKernel(func, cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ, cfg.blockDimX,
                                          cfg.blockDimY, cfg.blockDimZ, cfg.sharedMemBytes, cfg.hStream or 0,
                                          table, 0)
            return 0

        monkeypatch.setattr(launch, "_compiled_for_pdl", lambda kernel: True)
        monkeypatch.setattr(launch.driver, "launch_kernel_ex", lambda: fake_ex)
        with fake_cupy(fake):
            fake._heap[0] = 0x7F00_0000_0000
            _run(fake, case, out=True, calls=2, options=cupa.Options(programmatic_launch=pdl))
        seen[pdl] = [launch_[1:] for launch_ in fake.launches]
    assert seen[True] == seen[False]
    decode = [name for name, _ in ex_calls]
    attention = ("paged_decode", "paged_decode_mma", "paged_prefill")
    assert decode and set(decode) <= set(attention), decode
    assert all(attrs == [(launch.driver.PROGRAMMATIC_STREAM_SERIALIZATION, 1)] for _, attrs in ex_calls)
    assert len(ex_calls) == sum(1 for launch_ in seen[True] if launch_[0] in attention)


def test_no_programmatic_launch_for_a_kernel_compiled_below_sm_90(monkeypatch):
    """A kernel whose PTX targets an architecture below 9.0 has no griddepcontrol.wait: plain launch."""
    from cupa.kernels import launch

    calls = []
    monkeypatch.setattr(launch.driver, "launch_kernel_ex", lambda: lambda *a: calls.append(a) or 0)

    class Old:
        attributes = {"ptx_version": 80}

    class New:
        attributes = {"ptx_version": 90}

    assert not launch._compiled_for_pdl(Old()) and launch._compiled_for_pdl(New())
    assert not launch._compiled_for_pdl(object())
    fake = FakeCupy()
    with fake_cupy(fake):
        _run(fake, "decode_b8_long_split", out=True)   # the fake's kernels have no attributes
    assert calls == [] and any(launch_[1] == "paged_decode_mma" for launch_ in fake.launches)


def test_prologue_token_group_limit_matches_the_kernel():
    import re
    from pathlib import Path

    from cupa.kernels import prologue

    src = (Path(__file__).resolve().parents[1] / "cuda_src" / "prologue.cu").read_text()
    assert int(re.search(r"PROLOGUE_MAX_TPC = (\d+);", src).group(1)) == prologue.MAX_TOKENS_PER_CTA
    # warp k of a CTA copies its token k: never more tokens than warps
    assert prologue.MAX_TOKENS_PER_CTA <= prologue.PROLOGUE_THREADS // 32


def test_programmatic_launch_switch(monkeypatch):
    from cupa.device import describe_capability
    from cupa.kernels import launch

    hopper, ampere = describe_capability(9, 0), describe_capability(8, 0)
    monkeypatch.setattr(launch.driver, "launch_kernel_ex", lambda: object())
    assert launch.pdl_allowed(hopper, cupa.Options())
    assert not launch.pdl_allowed(hopper, cupa.Options(programmatic_launch=False))
    assert not launch.pdl_allowed(hopper, cupa.Options(launch="rawkernel"))
    assert not launch.pdl_allowed(ampere, cupa.Options())
    monkeypatch.setattr(launch.driver, "launch_kernel_ex", lambda: None)
    assert not launch.pdl_allowed(hopper, cupa.Options())


def test_launch_config_layout_matches_cuda_h():
    """CUlaunchConfig / CUlaunchAttribute as cuda.h lays them out on 64-bit Linux."""
    import ctypes

    from cupa.kernels import launch

    attr, cfg = launch.driver.LaunchAttribute, launch.driver.LaunchConfig
    assert ctypes.sizeof(attr) == 72
    assert attr.value.offset == 8
    assert cfg.hStream.offset == 32 and cfg.attrs.offset == 40
    assert cfg.numAttrs.offset == 48 and ctypes.sizeof(cfg) == 56


def test_one_workspace_allocation_per_call_and_kernels_per_call():
    fake = FakeCupy()
    with fake_cupy(fake):
        x, o, _ = _run(fake, "decode_b8_long_split", out=True)
        fake.launches.clear(), fake.allocations.clear()
        op = cupa.PagedAttention(num_heads=32, kv_num_heads=8)
        op(**x, out=o)
        names = [launch_[1] for launch_ in fake.launches]
        assert names == ["paged_prologue", "paged_decode_mma"]  # the last split CTA merges
        assert len(fake.allocations) == 1, "q workspace, split partials and counters come from one allocation"
        fake.launches.clear(), fake.allocations.clear()
        op(**x)                                          # no out=: the output is a second allocation
        assert len(fake.allocations) == 2


@pytest.mark.parametrize("case", ["decode_b8_long_split", "decode_b8_long_split_rotary"])
def test_workspace_carving_is_aligned_and_disjoint(case):
    """Rotary: Q goes through an (N, H, D) workspace first in the allocation; without a Q transform the
    decode kernel reads `query` itself and the workspace holds only the split partials and counters."""
    fake = FakeCupy()
    with fake_cupy(fake):
        x, _, _ = _run(fake, case, out=True)
        pro, dec = fake.launches
        base = int.from_bytes(pro[-1][16], "little")
        pro_counters = int.from_bytes(pro[-1][17], "little")
        q_dec = int.from_bytes(dec[-1][0], "little")
        part_o, part_ml, counters = (int.from_bytes(dec[-1][i], "little") for i in (11, 12, 13))
        assert pro_counters == counters, "the prologue zeroes the counters the decode kernel counts on"
        N, H, Hk, D = 8, 32, 8, 128
        if case.endswith("rotary"):
            assert q_dec == base and part_o >= base + N * H * D * 2
        else:
            assert q_dec == x["query"].data.ptr and part_o == base
        assert base % 256 == part_o % 256 == part_ml % 256 == counters % 256 == 0
        splits = dec[2][2]
        assert splits > 1
        assert part_ml >= part_o + N * H * splits * D * 4
        assert counters >= part_ml + N * H * splits * 8
        assert fake.allocations[-1] >= counters - base + N * Hk * 4


def test_workspace_outlives_the_launches():
    """The call's workspace is released only after every kernel reading it was enqueued (a block freed
    before the launch can be handed out again, or unmapped under a plain cudaMalloc allocator)."""
    import gc
    import weakref

    fake = FakeCupy()
    with fake_cupy(fake):
        x, o, _ = _run(fake, "decode_b8_long_split", out=True)   # warm: the recipe exists
        freed_at, real_alloc = [], fake.cuda.alloc

        def alloc(nbytes):
            mp = real_alloc(nbytes)
            weakref.finalize(mp, lambda: freed_at.append(len(fake.launches)))
            return mp

        fake.cuda.alloc = alloc
        fake.launches.clear()
        cupa.PagedAttention(num_heads=32, kv_num_heads=8)(**x, out=o)
        gc.collect()
        assert len(fake.launches) == 2 and freed_at == [2], freed_at


@pytest.mark.parametrize("case,write_q", [("decode_b8_long_split", 0), ("decode_b8_long_split_rotary", 1),
                                          ("prefill_shaped_packed", 1)])
def test_prologue_reads_q_only_when_it_transforms_it(case, write_q):
    """write_q (the prologue's 19th parameter) is 0 exactly when Q needs no transform; the grid then
    covers only the K/V rows (4 per CTA row group)."""
    fake = FakeCupy()
    with fake_cupy(fake):
        x, _, _ = _run(fake, case, out=True)
        pro = next(launch_ for launch_ in fake.launches if launch_[1] == "paged_prologue")
        assert int.from_bytes(pro[-1][19], "little") == write_q
        kw = CASES[case]
        H, Hk = kw.get("H", 32), kw.get("Hk", 8)
        rows = (H if write_q else 0) + 2 * Hk
        assert pro[2][1] == -(-rows // 4)


def test_prologue_uses_fewer_fuller_ctas_for_many_tokens():
    from cupa.kernels import prologue

    fake = FakeCupy()
    with fake_cupy(fake):
        x, attrs = fake_case(fake, B=4, N=4 * 2048, L=2048, H=32, Hk=8, D=128)
        op = cupa.PagedAttention(**attrs)
        plan = op.plan(**x)
        problem = plan.problem
        launcher = prologue.prologue_launcher(problem, plan.device, plan.options)
        # one row group per token, then 4 tokens per CTA (8192 tokens >= 4 x 10 CTAs x 132 SMs)
        assert launcher.grid[:2] == (4 * 2048 // 4, 1)
        assert launcher.args[-2:] == (np.int32(4 * 2048), np.int32(4))   # token_count, tokens_per_cta
        small = op.plan(**fake_case(fake, B=2, L=64, H=32, Hk=8, D=128)[0])
        assert prologue.prologue_launcher(small.problem, small.device, small.options).grid[:2] == (2, 4)
        assert prologue.prologue_launcher(small.problem, small.device, small.options).args[-1] == 1
        assert prologue.prologue_grid(problem, 132) == (1, 4)
        assert prologue.prologue_grid(problem, 400) == (1, 2)   # 8192 // (10 x 400)
        assert prologue.prologue_grid(problem, 500) == (1, 1)    # 8192 // (10 x 500) = 1


def test_no_workspace_without_splits_or_q_transform():
    fake = FakeCupy()
    with fake_cupy(fake):
        x, o, _ = _run(fake, "decode_gqa_fp16", out=True)
        fake.allocations.clear()
        op = cupa.PagedAttention(num_heads=32, kv_num_heads=8)
        op(**x, out=o)
        assert fake.allocations == []
        pro, dec = fake.launches[-2:]
        assert int.from_bytes(dec[-1][0], "little") == x["query"].data.ptr


def test_workspaces_are_kept_alive_inside_a_capture_scope():
    fake = FakeCupy()
    with fake_cupy(fake):
        x, o, _ = _run(fake, "decode_b8_long_split", out=False)   # warm (recipe built)
        op = cupa.PagedAttention(num_heads=32, kv_num_heads=8)
        scope = graphs.CaptureScope()
        _capture._local.scope, before = scope, _capture.ACTIVE[0]
        _capture.ACTIVE[0] += 1
        try:
            result = op(**x)
        finally:
            _capture._local.scope = None
            _capture.ACTIVE[0] = before
        assert any(k is result for k in scope.kept)
        ws = [k for k in scope.kept if k is not result]
        assert len(ws) == 1 and ws[0].nbytes == fake.allocations[-1]


def test_recipe_is_built_once_per_plan_and_device():
    fake = FakeCupy(device_count=2)
    with fake_cupy(fake):
        x, o, _ = _run(fake, "decode_b8_long_split", out=True, calls=3)
        assert len(fake.compiled) == 2                  # prologue, decode: once each
        op = cupa.PagedAttention(num_heads=32, kv_num_heads=8)
        plan = op.plan(**x)
        op(**x, out=o)
        first = plan.state["recipe"]
        op(**x, out=o)
        assert plan.state["recipe"] is first and op.plan(**x) is plan
        with fake.cuda.Device(1):                      # the same shapes on another device: a plan of its own
            x1 = {k: (fake.empty(v.shape, v.dtype) if v is not None else None) for k, v in x.items()}
            o1 = fake.empty(o.shape, o.dtype)
        op(**x1, out=o1)
        plan1 = op.plan(**x1)
        assert plan1 is not plan and plan1.device.ordinal == 1 and plan.device.ordinal == 0
        assert plan1.problem == plan.problem and plan1.state["recipe"] is not first
        assert len(fake.compiled) == 4
        assert pickle.loads(pickle.dumps(plan.problem)) == plan.problem


def test_threads_get_their_own_parameter_buffers():
    """Threads launching the same problem concurrently (a thread switch inside every launch) never see
    each other's pointers."""
    fake = FakeCupy()
    with fake_cupy(fake):
        _run(fake, "decode_b8_long_split", out=True)
        op = cupa.PagedAttention(num_heads=32, kv_num_heads=8)
        owner, per_thread = {}, []
        for t in range(4):
            x, _ = fake_case(fake, B=8, L=4096)
            o = fake.empty(x["query"].shape, x["query"].dtype)
            for a in list(x.values()) + [o]:
                owner[a.data.ptr] = t
            per_thread.append((x, o))
        fake.launches.clear()
        fake.switch_in_launch = True
        errors = []

        def work(t):
            x, o = per_thread[t]
            try:
                for _ in range(25):
                    op(**x, out=o)
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert len(fake.launches) == 4 * 25 * 2
        for launch_ in fake.launches:
            owners = {owner[v] for v in (int.from_bytes(b, "little") for b in launch_[-1] if len(b) == 8)
                      if v in owner}
            assert len(owners) == 1, f"{launch_[1]} got pointers of threads {owners}"


def test_stream_argument_routes_the_launches():
    fake = FakeCupy()
    with fake_cupy(fake):
        x, o, _ = _run(fake, "decode_gqa_fp16", out=True)
        op = cupa.PagedAttention(num_heads=32, kv_num_heads=8)
        s = fake.cuda.Stream(non_blocking=True)
        fake.launches.clear()
        op(**x, out=o, stream=s)
        assert {l[5] for l in fake.launches} == {s.ptr}
        assert fake.get_current_stream() is fake._null     # the caller's current stream is restored
        with s:
            fake.launches.clear()
            op(**x, out=o)
        assert {l[5] for l in fake.launches} == {s.ptr}


def test_device_is_entered_only_when_not_current():
    fake = FakeCupy(device_count=2)
    with fake_cupy(fake):
        with fake.cuda.Device(1):
            x, o, _ = _run(fake, "decode_gqa_fp16", out=True)
        assert fake._device() == 0
        fake.launches.clear()
        op = cupa.PagedAttention(num_heads=32, kv_num_heads=8)
        seen = []
        real = fake.cuda.driver.launchKernel

        def spy(*a):
            seen.append(fake._device())
            return real(*a)

        fake.cuda.driver.launchKernel = spy   # bound by the new op's launch sequence
        op(**x, out=o)                        # inputs on device 1, device 0 current
        assert seen == [1, 1]                 # prologue and decode ran with device 1 current
        assert fake._device() == 0


def test_fast_input_path_keeps_the_general_errors():
    """Non-contiguous, misaligned and mismatched inputs still get the general path's errors."""
    cupy = pytest.importorskip("cupy")
    fake = FakeCupy(real_arrays=True)
    with fake_cupy(fake):
        x, attrs = fake_case(fake, B=2, L=64)
        op = cupa.PagedAttention(**attrs)
        kc = x["key_cache"]
        big = fake.empty((kc.shape[0] * 2,) + kc.shape[1:], kc.dtype)
        with pytest.raises(cupa.PagedAttentionError, match="key_cache: got a non-contiguous"):
            op(**{**x, "key_cache": big[::2]})
        q = x["query"]
        mem = cupy.cuda.memory.UnownedMemory(q.data.ptr + 8, q.nbytes, None, 0)
        shifted = cupy.ndarray(q.shape, q.dtype, memptr=cupy.cuda.MemoryPointer(mem, 0))
        with pytest.raises(cupa.PagedAttentionError, match="query: got a device pointer .* 16-byte alignment"):
            op(**{**x, "query": shifted})
        with pytest.raises(cupa.PagedAttentionError, match="out: got shape"):
            op(**x, out=fake.empty((q.shape[0], 7), q.dtype))
        with pytest.raises(cupa.PagedAttentionError, match="out: got dtype float32"):
            op(**x, out=fake.empty(q.shape, np.float32))
        with pytest.raises(cupa.PagedAttentionError, match="out: got a non-contiguous"):
            op(**x, out=fake.empty((q.shape[0], 2 * q.shape[1]), q.dtype)[:, ::2])
        assert op(**x) is not None


def test_unknown_launch_route_is_an_options_error():
    with pytest.raises(cupa.PagedAttentionError, match="options.launch: got 'bogus'; expected one of 'fast', "
                                                       "'rawkernel'"):
        cupa.Options(launch="bogus")
    with pytest.raises(ValueError, match="route"):
        launch.Sequence([], 0, route="bogus")


def test_paged_attention_function_reuses_bound_ops():
    from cupa import api

    api._bound_op.cache_clear()
    base = dict(num_heads=4, kv_num_heads=2, scale=0.0, softcap=0.0, local_window_size=-1, is_causal=1,
                do_rotary=0, rotary_interleaved=0, rotary_offset=0, qk_norm_epsilon=1e-6, k_quant_type="NONE",
                v_quant_type="NONE", k_cache_dtype="", v_cache_dtype="", kv_cache_layout="SEPARATE",
                v_head_size=0, qk_output=0, return_lse=False, options=None)

    def op_for(**changes):
        return api._op_for(*{**base, **changes}.values())

    a = op_for()
    assert op_for() is a and a.attributes.num_heads == 4
    assert op_for(num_heads=8) is not a
    for _ in range(2):   # True == 1, but a bool is rejected, every time (typed cache)
        with pytest.raises(cupa.PagedAttentionError, match="is_causal"):
            op_for(is_causal=True)
    with pytest.raises(cupa.PagedAttentionError, match="scale"):
        op_for(scale=[1.0])                             # unhashable: the attribute error, not lru_cache's
    assert op_for(scale=1) is not op_for(scale=1.0)
    assert op_for(options=cupa.Options(launch="rawkernel")) is not a
    assert op_for(options=cupa.Options(launch="rawkernel")) is op_for(options=cupa.Options(launch="rawkernel"))


def test_paged_attention_function_matches_the_bound_op():
    fake = FakeCupy()
    with fake_cupy(fake):
        x, attrs = fake_case(fake, B=2, L=300)
        op = cupa.PagedAttention(**attrs)
        fake._heap[0] = 1 << 40
        op(**x)
        bound = fake.launches[:]
        fake.launches.clear()
        fake._heap[0] = 1 << 40
        cupa.paged_attention(**x, **attrs)
        assert fake.launches == bound


# -- GPU: the two routes give the same bits -----------------------------------------------------------------

GPU_CASES = {
    "decode_fp16_mma": dict(B=5, H=8, Hk=2, D=128),
    "decode_fp32_cuda_cores": dict(B=3, H=8, Hk=2, D=64, dtype="float32"),
    "decode_bf16_long_splits": dict(B=3, H=16, Hk=2, D=128, dtype="bfloat16", past=[3000, 17, 900]),
    "decode_int8_per_tensor": dict(B=4, H=8, Hk=2, D=128, cache="int8", k_quant="PER_TENSOR",
                                   v_quant="PER_CHANNEL", past=[700, 1500, 3, 90]),
    "decode_fp8_per_channel": dict(B=4, H=8, Hk=2, D=64, cache="fp8", past=[400, 2100, 33, 5]),
    "decode_features": dict(B=6, H=8, Hk=2, D=64, rotary=True, interleaved=True, qk_norm=True, sink=True,
                            softcap=30.0, window=37, packed=True, query_positions=True),
    "prefill_shaped": dict(q_lens=[3, 0, 17, 1, 0, 40], past=[5, 9, 0, 100, 0, 31], H=4, Hk=4, D=64, rotary=True),
    "prefill_shaped_int8": dict(q_lens=[33, 7], past=[200, 0], H=8, Hk=2, D=128, cache="int8"),
    # the wgmma prefill on compute capability 9.0 (tensor-map arguments), the mma.sync one elsewhere
    "prefill_shaped_d128": dict(q_lens=[130, 0, 64], past=[40, 7, 0], H=8, Hk=2, D=128),
}


@pytest.fixture
def gpu_cp():
    return pytest.importorskip("cupy")


def _device_run(cp, inputs, attrs, *, mode, out, md=None, backend="auto", stream=None, **options):
    """One call on fresh device copies on launch route ``mode``; returns (output bytes, key/value cache bytes)."""
    from tests import util

    dev = util.to_device(cp, inputs)
    o = None
    if out:
        D = dev["key_cache"].shape[-1]
        o = cp.full((dev["query"].shape[0], attrs["num_heads"] * D), np.nan, dtype=dev["query"].dtype)
    op = cupa.PagedAttention(**util.with_options(attrs, launch=mode, backend=backend, **options))
    got = op(**dev, attention_metadata=md, out=o, stream=stream)
    if o is not None:
        assert got is o
    cp.cuda.Device().synchronize()
    return tuple(cp.asnumpy(a).view(np.uint8).tobytes() for a in (got, dev["key_cache"], dev["value_cache"]))


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_CASES))
@pytest.mark.parametrize("out", [False, True])
@pytest.mark.parametrize("via", ["op", "decode_backend"])
def test_gpu_fast_route_is_bit_identical_to_rawkernel(gpu_cp, rng, case, out, via):
    from tests import util

    kw = dict(GPU_CASES[case])
    cache = kw.get("cache", "T")
    inputs, attrs = util.build(rng, **kw)
    md = [1, 4096] if "splits" in case else None
    backend = "decode" if via == "decode_backend" else "auto"
    raw = _device_run(gpu_cp, inputs, attrs, mode="rawkernel", out=out, md=md, backend=backend)
    fast = _device_run(gpu_cp, inputs, attrs, mode="fast", out=out, md=md, backend=backend)
    for name, a, b in zip(("output", "key_cache", "value_cache"), raw, fast):
        assert a == b, f"{case}: {name} differs between the rawkernel and the fast route"
    if via == "op" and out:   # and both are right (the reference, contract §6 tolerances)
        util.check_against_reference(gpu_cp, inputs, attrs, metadata=md, dtype=kw.get("dtype", "float16"), cache=cache)


@pytest.mark.gpu
def test_gpu_fast_route_on_a_side_stream_and_threads(gpu_cp, rng):
    from tests import util

    cp = gpu_cp
    inputs, attrs = util.build(rng, B=4, H=8, Hk=2, D=128, past=[1000, 20, 300, 2500])
    s = cp.cuda.Stream(non_blocking=True)
    raw = _device_run(cp, inputs, attrs, mode="rawkernel", out=True, stream=s)
    fast = _device_run(cp, inputs, attrs, mode="fast", out=True, stream=s)
    assert raw == fast
    results, errors = [], []

    def work():
        try:
            results.append(_device_run(cp, inputs, attrs, mode="fast", out=True))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and all(r == raw for r in results)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fast", "rawkernel"])
def test_gpu_fast_route_captures_and_replays(gpu_cp, rng, mode):
    """Replays of a graph captured on either route give the eager rawkernel bits; the workspace is kept."""
    from tests import util

    cp = gpu_cp
    inputs, attrs = util.build(rng, B=4, H=8, Hk=2, D=128, past=[1000, 20, 300, 2500])
    eager = _device_run(cp, inputs, attrs, mode="rawkernel", out=True, md=[1, 4096])
    dev = util.to_device(cp, inputs)
    op = cupa.PagedAttention(**util.with_options(attrs, launch=mode))
    kc0, vc0 = dev["key_cache"].copy(), dev["value_cache"].copy()
    g = cupa.capture_graph(lambda: op(**dev, attention_metadata=[1, 4096]))
    assert any(isinstance(k, launch.Workspace) for k in g.kept)
    with g.stream:
        for _ in range(2):
            dev["key_cache"][...] = kc0
            dev["value_cache"][...] = vc0
            cp.get_default_memory_pool().free_all_blocks()
            junk = [cp.full(1 << 20, 7, dtype=cp.uint8) for _ in range(4)]   # churn the caller's pool
            g.replay()
            got = tuple(cp.asnumpy(a).view(np.uint8).tobytes()
                        for a in (g.outputs, dev["key_cache"], dev["value_cache"]))
            assert got == eager
            del junk
    g.close()


@pytest.mark.gpu
def test_gpu_torch_inputs_both_routes(gpu_cp, rng):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    from tests import util

    cp = gpu_cp
    inputs, attrs = util.build(rng, B=3, H=8, Hk=2, D=128, past=[100, 2000, 7])
    results = {}
    for mode in ("rawkernel", "fast"):
        t = {k: (torch.from_dlpack(cp.asarray(v)) if isinstance(v, np.ndarray) else v) for k, v in inputs.items()}
        got = cupa.PagedAttention(**util.with_options(attrs, launch=mode))(**t, attention_metadata=[1, 2048])
        torch.cuda.synchronize()
        assert isinstance(got, torch.Tensor)
        results[mode] = (got.view(torch.uint8).cpu().numpy().tobytes(),
                         t["key_cache"].view(torch.uint8).cpu().numpy().tobytes())
    assert results["fast"] == results["rawkernel"]


@pytest.mark.gpu
def test_gpu_programmatic_launch_is_on_where_the_device_has_it(gpu_cp, rng):
    """On compute capability 9.0+ the fast route launches the decode kernel programmatically (so the
    GPU tests of the fast route exercise griddepcontrol), and Options(programmatic_launch=False) gives
    the same bits."""
    from cupa.device import device_info
    from tests import util

    cp = gpu_cp
    dev_id = cp.cuda.runtime.getDevice()
    cc = int(cp.cuda.Device(dev_id).compute_capability)
    assert launch.pdl_allowed(device_info(dev_id), cupa.Options()) == (cc >= 90)
    if cc >= 90:   # the decode kernels are compiled for the device's architecture: the wait is in them
        from cupa import jit
        from cupa.kernels import registry

        assert launch._compiled_for_pdl(jit.get_kernel(registry.decode_mma_spec("float16", "T", 128, 3)))
    inputs, attrs = util.build(rng, B=5, H=8, Hk=2, D=128, past=[1000, 20, 300, 2500, 0], rotary=True)
    on = _device_run(cp, inputs, attrs, mode="fast", out=True, md=[1, 4096])
    off = _device_run(cp, inputs, attrs, mode="fast", out=True, md=[1, 4096], programmatic_launch=False)
    assert on == off

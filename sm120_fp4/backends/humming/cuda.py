"""The activation dequantization as one CUDA C kernel (NVRTC, driver launch: a few us of host time per call, a
Triton launch ~30 us on the H200); bit for bit nvfp4.dequantize_unscaled's values."""

from __future__ import annotations

import ctypes
import threading

import torch

THREADS = 128  # groups (16 elements) per block

_SOURCE = r"""
__device__ __forceinline__ float e2m1(unsigned int c) {
    unsigned int mag = c & 7u, e = mag >> 1, m = mag & 1u;
    float v = e == 0u ? 0.5f * (float)m : (1.0f + 0.5f * (float)m) * (float)(1u << (e - 1u));
    return (c & 8u) ? -v : v;
}

__device__ __forceinline__ float e4m3(unsigned int b) {
    unsigned int exp = (b >> 3) & 15u, man = b & 7u;
    float v;
    if ((b & 127u) == 127u) {
        v = __int_as_float(0x7fc00000);
    } else if (exp == 0u) {
        v = (float)man * 0.001953125f;
    } else {
        v = __int_as_float((int)((exp + 120u) << 23 | man << 20));  /* (1 + man/8) * 2^(exp - 7) */
    }
    return (b & 128u) ? -v : v;
}

__device__ __forceinline__ unsigned int to16(float v, int bf16) {
    unsigned short h;
    if (bf16) {
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
    } else {
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    }
    return (unsigned int)h;
}

extern "C" __global__ void __launch_bounds__(128) dequant_fp4(
        const unsigned char* __restrict__ a, const unsigned char* __restrict__ sf, unsigned short* __restrict__ out,
        long long half_k, long long kp, int bf16) {
    long long row = blockIdx.x;
    long long g = (long long)blockIdx.y * blockDim.x + threadIdx.x;
    if (g * 8 >= half_k) return;
    long long sf_off = (row / 128) * 128 * kp + (g / 4) * 512 + (row % 32) * 16 + ((row % 128) / 32) * 4 + (g % 4);
    float s = e4m3(sf[sf_off]);
    const unsigned char* src = a + row * half_k + g * 8;
    unsigned int lo, hi;
    if ((((unsigned long long)src) & 7ull) == 0ull) {
        uint2 v = *reinterpret_cast<const uint2*>(src);
        lo = v.x; hi = v.y;
    } else {
        lo = hi = 0u;
        for (int i = 0; i < 4; ++i) { lo |= (unsigned int)src[i] << (8 * i); hi |= (unsigned int)src[4 + i] << (8 * i); }
    }
    unsigned int w[8];
    #pragma unroll
    for (int i = 0; i < 8; ++i) {
        unsigned int byte = ((i < 4 ? lo : hi) >> (8 * (i & 3))) & 255u;
        w[i] = to16(e2m1(byte & 15u) * s, bf16) | (to16(e2m1(byte >> 4) * s, bf16) << 16);
    }
    uint4* dst = reinterpret_cast<uint4*>(out + row * 2 * half_k + g * 16);
    dst[0] = make_uint4(w[0], w[1], w[2], w[3]);
    dst[1] = make_uint4(w[4], w[5], w[6], w[7]);
}
"""

_lock = threading.Lock()
_functions: dict[int, object] = {}  # device index -> CUfunction
_ARG_TYPES = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_int)


class Unavailable(RuntimeError):
    """This kernel cannot be built or loaded here (the caller dequantizes with torch operations)."""


def _check(result, what: str) -> tuple:
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise Unavailable(f"{what} failed: {err!r}")
    return tuple(rest)


def _compile(major: int, minor: int) -> bytes:
    from cuda.bindings import nvrtc

    (prog,) = _check(
        nvrtc.nvrtcCreateProgram(_SOURCE.encode(), b"sm120_fp4_dequant.cu", 0, [], []), "nvrtcCreateProgram"
    )
    try:
        opts = [f"--gpu-architecture=sm_{major}{minor}".encode(), b"-std=c++17"]
        err = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0]
        if int(err) != 0:
            (size,) = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise Unavailable(
                f"NVRTC could not compile the dequantization kernel for sm_{major}{minor}: {err!r} "
                f"{log.decode(errors='replace').strip()[:400]}"
            )
        (size,) = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def load(device: torch.device) -> None:
    """Compile and load the kernel on `device` (outside capture); raise Unavailable where it cannot be."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in _functions:
        return
    with _lock:
        if index in _functions:
            return
        try:
            from cuda.bindings import driver
        except Exception as exc:
            raise Unavailable(f"cuda-bindings does not import: {type(exc).__name__}: {exc}") from exc
        major, minor = torch.cuda.get_device_capability(index)
        cubin = _compile(major, minor)
        with torch.cuda.device(index):
            torch.cuda.init()
            torch.empty(1, device=f"cuda:{index}")  # the device's primary context is current from here
            (module,) = _check(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
            (function,) = _check(driver.cuModuleGetFunction(module, b"dequant_fp4"), "cuModuleGetFunction")
        _functions[index] = function


def launch(a: torch.Tensor, sf_bytes: torch.Tensor, out: torch.Tensor, kp: int) -> None:
    """Dequantize `a` (M, K/2) with its swizzled scale bytes into a fresh contiguous `out` (M, K) (after load())."""
    from cuda.bindings import driver

    index = a.device.index
    if torch.cuda.current_device() != index:  # a driver launch uses the current context: the tensors' device's
        with torch.cuda.device(index):
            return launch(a, sf_bytes, out, kp)
    # K % 16 == 0 and `out` fresh (16-byte aligned): dequantize_activations' arguments passed mm_fp4's check.
    m, half_k = a.shape
    function = _functions[index]
    stream = torch._C._cuda_getCurrentRawStream(index)  # PyTorch's raw accessor: no Stream object per call
    blocks = (half_k // 8 + THREADS - 1) // THREADS
    values = (a.data_ptr(), sf_bytes.data_ptr(), out.data_ptr(), half_k, kp, 1 if out.dtype == torch.bfloat16 else 0)
    args = (values, _ARG_TYPES)
    _check(driver.cuLaunchKernel(function, m, blocks, 1, THREADS, 1, 1, 0, stream, args, 0), "cuLaunchKernel")

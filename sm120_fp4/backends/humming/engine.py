"""Humming (``humming-kernels``, the vLLM project's JIT-compiled quantized GEMMs): its version, compiler and kernel
cache, and the engine this package calls it through (the real one, or a test's stand-in)."""

from __future__ import annotations

import json
import os
import shutil
import threading
from dataclasses import dataclass
from typing import Any

import torch

from ...devices import Device
from ...versions import installed_version, version_in

DISTRIBUTION = "humming-kernels"
_GB10_CRASH = ">=0.1.10,<0.1.12"  # releases that crash on GB10 (sm_121) at an NVML memory-clock query (vllm #49554)
# The padding SGLang's own Humming methods ask for (some per-M kernels tile N by 256, K by 128; the H200
# run showed K=480/N=160 failing with less): an aligned weight is converted in place, another padded beside.
N_ALIGN, K_ALIGN = 256, 128
lock = threading.RLock()  # every record of this package's Humming state


def version() -> str | None:
    """Return the installed humming-kernels version, without importing it."""
    return installed_version(DISTRIBUTION, "humming")


def cache_dir() -> str:
    """Return where Humming keeps compiled kernels across restarts (HUMMING_CACHE_DIR, else its default)."""
    return os.environ.get("HUMMING_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".humming", "cache")


def _nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidates = [os.path.join(home, "bin", "nvcc")] if home else []
    found = os.environ.get("CUDA_NVCC_PATH") or shutil.which("nvcc")
    return found or next((c for c in [*candidates, "/usr/local/cuda/bin/nvcc"] if os.path.exists(c)), None)


def _has_nvrtc() -> bool:
    try:
        from cuda.bindings import nvrtc  # noqa: F401  (Humming's default compiler)
    except Exception:
        return False
    return True


def compiler() -> tuple[str | None, str]:
    """Return which compiler Humming would JIT with here ("nvrtc" | "nvcc" | None) and how it was found."""
    forced, nvcc = os.environ.get("HUMMING_COMPILER", "").lower(), _nvcc()
    if forced == "nvcc":
        return ("nvcc", f"HUMMING_COMPILER=nvcc: {nvcc}") if nvcc else (None, "HUMMING_COMPILER=nvcc but no nvcc found")
    if _has_nvrtc():
        return "nvrtc", "cuda-bindings' NVRTC"
    if forced == "nvrtc":
        return None, "HUMMING_COMPILER=nvrtc but cuda-bindings' nvrtc does not import"
    if nvcc:
        return "nvcc", nvcc
    return None, "neither NVRTC (cuda-bindings) nor nvcc (CUDA toolkit) is available"


@dataclass
class Prepared:
    """One weight (dense (N, K) or E experts) in the engine's layout."""

    tensors: dict[str, torch.Tensor]  # what a call reads ("weight", "weight_scale"), views of SGLang's once in place
    meta: Any  # the engine's own description (kernel configuration)
    label: str
    n: int
    k: int
    experts: int | None
    dtype: torch.dtype
    scale_2: torch.Tensor | None = None  # the factor the conversion left, times each call's alpha (None: 1)
    locks: torch.Tensor | None = None
    kernels: Any = None  # the engine's compiled kernel table (Humming: its configs tensor), made at the first call


class Engine:
    """The Humming calls this package makes; the real one imports Humming, a stand-in (tests) does not."""

    name = "humming"

    def unusable(self, device: Device) -> str | None:  # pragma: no cover - interface
        raise NotImplementedError

    def prepare(self, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, experts: int | None) -> Prepared:
        """Return `weight` (E?, N, K/2) packed E2M1 and linear `scale` (E?, N, K/16) E4M3 in the engine's layout."""
        raise NotImplementedError  # pragma: no cover

    def gemm(self, prepared: Prepared, x: torch.Tensor, scale_2: torch.Tensor, out: torch.Tensor) -> None:
        """Write out (M, N) = scale_2 * (x @ W_unscaled^T); x (M, K) in prepared.dtype."""
        raise NotImplementedError  # pragma: no cover

    def grouped_gemm(self, prepared: Prepared, x, scale_2, offsets: torch.Tensor, out: torch.Tensor) -> None:
        """Write rows offsets[e]:offsets[e+1] of x (sorted by expert) times expert e, scaled by scale_2[e]."""
        raise NotImplementedError  # pragma: no cover


class _HummingEngine(Engine):
    """The real thing: humming-kernels' HummingLayer conversion and its GEMM launcher."""

    def unusable(self, device: Device) -> str | None:
        found = version()
        if found is None:
            return f"{DISTRIBUTION} is not installed (pip install {DISTRIBUTION})"
        if not device.is_cuda:
            return "Humming's kernels need a CUDA GPU; this device is the simulated CPU"
        if not torch.cuda.is_available() or device.index >= torch.cuda.device_count():
            return f"torch {torch.__version__} cannot use CUDA device {device.index} (no driver, or a CPU build)"
        real = torch.cuda.get_device_capability(device.index)
        if real < (8, 0):
            return f"Humming's bf16/fp16-activation kernels need sm_80+ (this GPU is sm_{real[0]}{real[1]})"
        if real[0] == 12 and real[1] == 1 and version_in(found, _GB10_CRASH):
            return f"{DISTRIBUTION} {found} crashes on GB10 at an NVML memory-clock query (vllm #49554); use >= 0.1.12"
        tool, why = compiler()
        if tool is None:
            return f"Humming JIT-compiles its kernels and cannot here: {why}"
        try:
            import humming.layer  # noqa: F401
        except Exception as exc:  # a broken install raising anything
            return f"{DISTRIBUTION} {found} does not import: {type(exc).__name__}: {exc}"
        return None

    def prepare(self, weight, scale, dtype, experts):
        # The calls SGLang's own Humming methods make (HummingLinearMethod / HummingMoEMethod), 0.1.12 and newer.
        from humming.layer import HummingMethod
        from humming.schema import BaseWeightSchema

        n, k = weight.shape[-2], weight.shape[-1] * 2
        device = weight.device
        schema = BaseWeightSchema.from_config({"quant_method": "modelopt", "quant_algo": "NVFP4"})
        with torch.cuda.device(device):
            ones = torch.ones(experts or 1, dtype=torch.float32, device=device)  # alpha comes with every call
            raw = {"weight": weight, "weight_scale": scale, "weight_scale_2": ones}
            shapes = dict(shape_n_stacks=[n], shape_k_stacks=[k], param_dtype=dtype, num_experts=experts)
            hschema, tensors = schema.convert_humming(tensors=raw, **shapes)
            holder = torch.nn.Module()
            for name, tensor in tensors.items():
                setattr(holder, name, torch.nn.Parameter(tensor, requires_grad=False))
            del tensors
            pads = dict(pad_n_to_multiple=N_ALIGN, pad_k_to_multiple=K_ALIGN, has_bias=False, torch_dtype=dtype)
            shapes = dict(shape_n=n, shape_k=k, weight_schema=hschema, num_experts=experts)
            HummingMethod.prepare_layer_meta(layer=holder, **shapes, **pads)
            HummingMethod.transform_humming_layer(holder)
        meta = holder.humming_metas[""]
        out = {"weight": holder.weight.data, "weight_scale": holder.weight_scale.data}
        scale_2 = getattr(holder, "weight_scale_2", None)
        scale_2 = None if scale_2 is None else scale_2.data.float().reshape(-1)
        if scale_2 is not None and bool((scale_2 == 1).all()):  # at load, outside capture: a host read is fine
            scale_2 = None
        gemm_type = "grouped_contiguous" if experts else "dense"
        config = {
            "layer_config": meta.to_str(),
            "compute_config": json.dumps({"use_f16_accum": False, "gemm_type": gemm_type}),
        }
        label = f"N={n} K={k}" + (f" E={experts}" if experts else "") + f" {str(dtype).removeprefix('torch.')}"
        locks = torch.zeros(2048, dtype=torch.int32, device=device)  # stream-K state, one per layer
        return Prepared(out, config, label, n, k, experts, dtype, scale_2, locks)

    @staticmethod
    def _kernels(prepared):
        """Return the layer's kernel table, resolved once at its first call (outside capture)."""
        # Humming's per-call path (ops.humming_gemm) re-serialises and looks up its configuration each time.
        if prepared.kernels is None:
            from humming.kernel.humming import HummingKernel

            with torch.cuda.device(prepared.tensors["weight"].device):
                prepared.kernels = HummingKernel.prepare_kernels(
                    prepared.meta["layer_config"], prepared.meta["compute_config"], prepared.meta.get("tuning_config")
                )
        return prepared.kernels

    @classmethod
    def _launch(cls, prepared, x, scale_2, out, **launch):
        from humming import ops

        weights = dict(weight=prepared.tensors["weight"], weight_scale=prepared.tensors["weight_scale"])
        launch.update(weight_scale_2=scale_2, outputs=out, locks=prepared.locks)
        ops.launch_kernel(configs=cls._kernels(prepared), inputs=x, **weights, **launch)

    def gemm(self, prepared, x, scale_2, out):
        self._launch(prepared, x, scale_2, out)

    def grouped_gemm(self, prepared, x, scale_2, offsets, out):
        self._launch(prepared, x, scale_2, out, expert_layout=offsets, valid_shape_m=x.shape[0])


_engine: Engine = _HummingEngine()


def current_engine() -> Engine:
    """Return the engine in use."""
    return _engine


def swap_engine(new: Engine | None) -> Engine:
    """Put `new` in use (None: the real Humming); return the previous one."""
    global _engine
    previous, _engine = _engine, new or _HummingEngine()
    return previous

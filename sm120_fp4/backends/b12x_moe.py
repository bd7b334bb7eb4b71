"""FlashInfer's b12x NVFP4 fused MoE (``flashinfer.fused_moe.B12xMoEWrapper``, 0.7.2+) as a MoE backend.

It runs on the tensors SGLang prepares for ``cutlass_fused_moe``, without a copy: w13 (E, 2I, H/2)
rows [up; gate] (or (E, I, H/2) for relu2), w2 (E, H, I/2), the 128x4-swizzled block scales read
through a zero-copy 6-D view (:func:`mma_scale_view`, FlashInfer's ``convert_sf_to_mma_layout``).

Its scales run the other way: b12x divides activations by their global scale, where the backend
convention (cutlass's) multiplies by an encode scale. The scales it takes are derived here, per
layer, and owned here: ``input_global_scale = 1 / a1_gscale``, ``w1_alpha = w13_alpha * a1_gscale``,
``fc2_input_scale = 1 / a2_gscale``, ``w2_alpha = w2_alpha``. They are refreshed IN PLACE (the same
tensors) when the layer's own scales change (a weight update), so a CUDA graph captured earlier reads
the new values; the wrapper's folded copy of ``w1_alpha`` is refolded into its own tensor too.

One workspace per (device, configuration: E, top-k, H, I, activation), allocated by the first call of
that configuration (a served layer's check, in the weights hook) and never replaced: every layer of
the configuration has its own wrapper (its cached weight views) sharing that workspace and output
buffer, as FlashInfer's wrapper API intends. Calls larger than the workspace's token count run in
chunks of it. :func:`describe` gives the workspaces' bytes (status).

Where it cannot serve, :func:`supported` (the device, the toolchain, the engine's settings) or
:func:`layer_problem` (a layer's sizes and dtype) says why. Tests replace the wrapper with a CPU
stand-in through :func:`use_wrapper`.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, fields, is_dataclass
from typing import Callable, Iterator

import torch

from .. import nvfp4
from ..devices import Device
from ..errors import not_accepted
from .flashinfer import check_moe_args, moe_supported, toolchain
from .flashinfer import version as flashinfer_version

__all__ = [
    "NAME",
    "MIN_CUDA",
    "INTER_ALIGN",
    "MAX_TOKENS",
    "supported",
    "layer_problem",
    "engine_check",
    "mma_scale_view",
    "derived_scales",
    "use_wrapper",
    "fused_moe",
    "describe",
    "reset",
]

NAME = "b12x"
MIN_CUDA = (13, 0)  # B12xMoEWrapper raises below CUDA 13 (get_cuda_version())
INTER_ALIGN = 128  # I % 128: the gate/up tile split (_LEVEL_TILE_N); below it 0.7.2 pads a private copy per layer
HIDDEN_ALIGN_FROM = (0, 7, 4)  # 0.7.4 also requires H % 128
MAX_TOKENS = 1024  # tokens per wrapper call (the workspace's size); larger calls run in chunks of it
ACTIVATIONS = {"swiglu": "silu", "relu2": "relu2"}  # the convention's name -> b12x's

WrapperFactory = Callable[..., object]

_lock = threading.Lock()
_factory: WrapperFactory | None = None  # a stand-in (tests); None: FlashInfer's B12xMoEWrapper
# Engine checks (an engine home registers its own: SGLang's pdmux, deterministic inference, EP):
# each returns why b12x cannot serve this process, or None.
_engine_checks: list[Callable[[], str | None]] = []


def engine_check(check: Callable[[], str | None]) -> Callable[[], str | None]:
    """Register `check() -> reason | None`: a setting of the serving engine under which b12x cannot serve."""
    with _lock:
        if check not in _engine_checks:
            _engine_checks.append(check)
    return check


@contextlib.contextmanager
def use_wrapper(factory: WrapperFactory) -> Iterator[None]:
    """Inside the block, b12x's wrapper is `factory` (called as B12xMoEWrapper is): a stand-in replaces
    FlashInfer's kernel and the real-GPU requirement; the toolchain and every other check still apply."""
    global _factory
    previous, _factory = _factory, factory
    reset()
    try:
        yield
    finally:
        _factory = previous
        reset()


def _version_tuple() -> tuple[int, ...] | None:
    found = flashinfer_version()
    if found is None:
        return None
    parts = []
    for p in found.split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _wrapper_class() -> WrapperFactory:
    from flashinfer.fused_moe import B12xMoEWrapper  # exported only where the CuTe DSL imports

    return B12xMoEWrapper


def supported(device: Device) -> tuple[bool, str | None]:
    """Whether b12x's MoE can serve on `device` in this process, and why not."""
    tc = toolchain()
    if tc.cuda is None or tc.cuda < MIN_CUDA:
        return False, (
            f"b12x MoE needs CUDA >= {MIN_CUDA[0]}.{MIN_CUDA[1]}; found "
            f"{'unknown' if tc.cuda is None else f'{tc.cuda[0]}.{tc.cuda[1]}'} ({tc.cuda_source})"
        )
    if tc.cute_dsl_problem is not None:
        return False, f"b12x MoE needs the CuTe DSL: {tc.cute_dsl_problem}"
    with _lock:
        checks = list(_engine_checks)
    for check in checks:
        reason = check()
        if reason:
            return False, reason
    if tuple(device.capability) not in ((12, 0), (12, 1)):
        return False, f"b12x MoE runs on sm_120/sm_121 only (found sm_{device.sm})"
    if _factory is not None:
        return True, None
    ok, reason = moe_supported("cutlass", device)  # a real GPU, FlashInfer installed
    if not ok:
        return False, reason
    try:
        _wrapper_class()
    except Exception as exc:  # ImportError (no CuTe DSL), or a broken install raising anything
        return False, f"flashinfer {flashinfer_version()} has no B12xMoEWrapper: {type(exc).__name__}: {exc}"
    return True, None


def layer_problem(experts: int, hidden: int, inter: int, activation: str, dtype: torch.dtype) -> str | None:
    """Why b12x cannot serve a layer of these sizes and dtype, or None."""
    if dtype != torch.bfloat16:
        return f"b12x MoE takes bf16 activations and output only (this layer: {str(dtype).removeprefix('torch.')})"
    if activation not in ACTIVATIONS:
        return f"b12x MoE serves SwiGLU without clamps and relu2 only (this layer: {activation})"
    if inter % INTER_ALIGN:
        return f"b12x MoE needs I % {INTER_ALIGN} == 0 (this layer: I={inter}; below it FlashInfer pads a private copy per layer)"
    version = _version_tuple()
    if version is not None and version >= HIDDEN_ALIGN_FROM and hidden % INTER_ALIGN:
        return f"b12x MoE in flashinfer {flashinfer_version()} needs H % {INTER_ALIGN} == 0 (this layer: H={hidden})"
    return None


def mma_scale_view(sf: torch.Tensor, rows: int, cols: int, experts: int) -> torch.Tensor:
    """The 6-D MMA view (32, 4, m_tiles, 4, k_tiles, E) of per-expert 128x4-swizzled block scales,
    zero-copy (FlashInfer's ``convert_sf_to_mma_layout``)."""
    rp, cp = nvfp4.swizzled_scale_shape(rows, cols)
    return sf.reshape(experts, rp // 128, cp // 4, 32, 4, 4).permute(3, 4, 1, 5, 2, 0)


@dataclass
class _Derived:
    """One layer's scales in b12x's direction, and the versions of the scales they were made from."""

    input_global_scale: torch.Tensor
    w1_alpha: torch.Tensor
    fc2_input_scale: torch.Tensor
    w2_alpha: torch.Tensor
    source: tuple = ()

    def refresh(self, w13_alpha, w2_alpha, a1, a2) -> None:
        """Recompute in place (the same tensors: graphs captured earlier read the new values)."""
        torch.reciprocal(a1.float().reshape(self.input_global_scale.shape), out=self.input_global_scale)
        torch.mul(w13_alpha.float(), a1.float(), out=self.w1_alpha)
        torch.reciprocal(a2.float().reshape(self.fc2_input_scale.shape), out=self.fc2_input_scale)
        self.w2_alpha.copy_(w2_alpha.float())
        self.source = _source(w13_alpha, w2_alpha, a1, a2)


def _source(*tensors: torch.Tensor) -> tuple:
    return tuple((t.data_ptr(), t._version) for t in tensors)


def derived_scales(w13_alpha, w2_alpha, a1, a2) -> dict[str, torch.Tensor]:
    """b12x's scales from the convention's (a fresh set; the backend keeps one per layer)."""
    d = _new_derived(w13_alpha, w2_alpha, a1, a2)
    return {f.name: getattr(d, f.name) for f in fields(d) if f.name != "source"}


def _new_derived(w13_alpha, w2_alpha, a1, a2) -> _Derived:
    d = _Derived(
        torch.empty(a1.shape, dtype=torch.float32, device=a1.device),
        torch.empty(w13_alpha.shape, dtype=torch.float32, device=w13_alpha.device),
        torch.empty(a2.shape, dtype=torch.float32, device=a2.device),
        torch.empty(w2_alpha.shape, dtype=torch.float32, device=w2_alpha.device),
    )
    d.refresh(w13_alpha, w2_alpha, a1, a2)
    return d


@dataclass
class _Layer:
    wrapper: object
    derived: _Derived


_workspaces: dict[tuple, object] = {}  # (device, E, top-k, H, I, activation) -> the first wrapper (owns the buffers)
_layers: dict[tuple, _Layer] = {}  # (config, the layer's weight pointers) -> its wrapper and scales


def reset() -> None:
    """Forget every wrapper and workspace (uninstall, tests)."""
    with _lock:
        _workspaces.clear()
        _layers.clear()


def _make_wrapper(config: tuple, device: torch.device, owner: object | None) -> object:
    _, experts, top_k, hidden, inter, activation = config
    factory = _factory or _wrapper_class()
    shared = {}
    if owner is not None:  # the configuration's buffers, never replaced
        shared = {
            "shared_static_workspace": getattr(owner, "_static_workspace", None),
            "shared_dynamic_workspace": getattr(owner, "_dynamic_workspace", None),
            "shared_output": getattr(owner, "_moe_output", None),
        }
    return factory(
        experts,
        top_k,
        hidden,
        inter,
        use_cuda_graph=True,
        max_num_tokens=MAX_TOKENS,
        output_dtype=torch.bfloat16,
        device=str(device),
        activation=ACTIVATIONS[activation],
        quant_mode="nvfp4",
        **shared,
    )


def _layer(config: tuple, key: tuple, device: torch.device, w13_alpha, w2_alpha, a1, a2) -> _Layer:
    with _lock:
        entry = _layers.get(key)
        if entry is None:
            owner = _workspaces.get(config)
            wrapper = _make_wrapper(config, device, owner)
            if owner is None:
                _workspaces[config] = wrapper
            entry = _layers[key] = _Layer(wrapper, _new_derived(w13_alpha, w2_alpha, a1, a2))
    if entry.derived.source != _source(w13_alpha, w2_alpha, a1, a2):  # the layer's scales changed: a weight update
        entry.derived.refresh(w13_alpha, w2_alpha, a1, a2)
        _refold(entry)
    return entry


def _refold(entry: _Layer) -> None:
    """The wrapper's folded FC1 alpha (w1_alpha * input_global_scale, 0.7.2-0.7.4), refolded in its own
    tensor: the wrapper would fold into a new one, which a captured graph does not read."""
    folded = getattr(entry.wrapper, "_folded_w1_alpha", None)
    d = entry.derived
    if isinstance(folded, torch.Tensor) and folded.shape == d.w1_alpha.shape:
        torch.mul(
            d.w1_alpha,
            d.input_global_scale.reshape(-1) if d.input_global_scale.numel() > 1 else d.input_global_scale,
            out=folded,
        )
        entry.wrapper._folded_w1_alpha_key = (
            d.w1_alpha.data_ptr(),
            d.input_global_scale.data_ptr(),
            d.w1_alpha._version,
            d.input_global_scale._version,
        )


def fused_moe(
    x,
    topk_ids,
    topk_weights,
    w13,
    w13_sf,
    w13_alpha,
    w2,
    w2_sf,
    w2_alpha,
    a1_gscale,
    a2_gscale,
    activation,
    out_dtype,
    out,
):
    """The backend convention (nvfp4.reference_moe_fp4's; -1: a slot that adds nothing) through b12x."""
    check_moe_args(
        x,
        topk_ids,
        topk_weights,
        w13,
        w13_sf,
        w13_alpha,
        w2,
        w2_sf,
        w2_alpha,
        a1_gscale,
        a2_gscale,
        activation,
        out_dtype,
        out,
    )
    experts, rows, hidden = w13.shape[0], w13.shape[1], w13.shape[2] * 2
    inter = w2.shape[2] * 2
    problem = layer_problem(experts, hidden, inter, activation, x.dtype)
    if problem is not None:
        raise not_accepted(
            "b12x fused MoE",
            "x" if x.dtype != torch.bfloat16 else "w2",
            x if x.dtype != torch.bfloat16 else w2,
            problem,
        )
    config = (str(x.device), experts, topk_ids.shape[1], hidden, inter, activation)
    key = (config, w13.data_ptr(), w2.data_ptr(), w13_sf.data_ptr(), w2_sf.data_ptr())
    entry = _layer(config, key, x.device, w13_alpha, w2_alpha, a1_gscale, a2_gscale)
    d = entry.derived
    w1_sf = mma_scale_view(w13_sf, rows, hidden, experts)
    w2_sf6 = mma_scale_view(w2_sf, hidden, inter, experts)
    ids = topk_ids if topk_ids.dtype == torch.int32 else topk_ids.to(torch.int32)
    for lo in range(0, x.shape[0], MAX_TOKENS):
        hi = min(lo + MAX_TOKENS, x.shape[0])
        result = entry.wrapper.run(
            x[lo:hi],
            w13,
            w1_sf,
            w2,
            w2_sf6,
            ids[lo:hi],
            topk_weights[lo:hi],
            w1_alpha=d.w1_alpha,
            w2_alpha=d.w2_alpha,
            fc2_input_scale=d.fc2_input_scale,
            input_global_scale=d.input_global_scale,
        )
        out[lo:hi].copy_(result)  # the wrapper returns a slice of its own output buffer
    return out


def _nbytes(obj: object, seen: set) -> int:
    if isinstance(obj, torch.Tensor):
        key = (obj.data_ptr(), obj.untyped_storage().nbytes() if obj.numel() else 0)
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes() if obj.numel() else 0
    if is_dataclass(obj) and not isinstance(obj, type):
        return sum(_nbytes(getattr(obj, f.name), seen) for f in fields(obj))
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o, seen) for o in obj)
    if hasattr(obj, "__dict__") and not callable(obj):
        return sum(_nbytes(v, seen) for v in vars(obj).values())
    return 0


def describe() -> dict:
    """What status shows: each configuration's workspace (its bytes), and the layers served."""
    with _lock:
        workspaces = dict(_workspaces)
        layers = len(_layers)
    out = []
    for (device, experts, top_k, hidden, inter, activation), owner in workspaces.items():
        seen: set = set()
        size = sum(
            _nbytes(getattr(owner, a, None), seen) for a in ("_static_workspace", "_dynamic_workspace", "_moe_output")
        )
        out.append(
            {
                "device": device,
                "config": f"E={experts} top_k={top_k} H={hidden} I={inter} {activation}",
                "max_tokens": MAX_TOKENS,
                "bytes": size,
            }
        )
    return {"workspaces": out, "layers": layers, "workspace_bytes": sum(w["bytes"] for w in out)}

"""FlashInfer's b12x NVFP4 fused MoE (``B12xMoEWrapper``, 0.7.2+) on the tensors SGLang prepares for cutlass (no
copy: block scales through a 6-D view), its scales derived here; tests patch in a CPU stand-in (:func:`_wrapper_class`)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields, is_dataclass
from typing import Callable

import torch

from .. import nvfp4
from ..devices import Device
from ..errors import not_accepted
from ..versions import version_in
from .convention import check_moe_args
from .flashinfer import moe_supported, toolchain_problem
from .flashinfer import version as flashinfer_version

NAME = "b12x"
MIN_CUDA = (13, 0)  # B12xMoEWrapper raises below CUDA 13 (get_cuda_version())
INTER_ALIGN = 128  # I % 128: the gate/up tile split (_LEVEL_TILE_N); below it 0.7.2 pads a private copy per layer
HIDDEN_ALIGN_FROM = ">=0.7.4.dev0"  # FlashInfer releases that also require H % 128 (0.7.4 on)
# FlashInfer #3807: b12x MoE fails to launch on SM120 for intermediate sizes of 1024 and more.
MAX_INTER = 1023
# vLLM #47365: b12x MoE returns empty or garbage output at TP=2 / PP=2 while one GPU is correct.
MULTI_RANK_ISSUE = "vLLM #47365"
MAX_TOKENS = 1024  # tokens per wrapper call (the workspace's size); larger calls run in chunks of it
ACTIVATIONS = {"swiglu": "silu", "relu2": "relu2"}  # the convention's name -> b12x's
_BUFFERS = ("_static_workspace", "_dynamic_workspace", "_moe_output")  # a wrapper's, shared per configuration

WrapperFactory = Callable[..., object]

_lock = threading.Lock()
# Settings of the serving engine under which b12x cannot serve (SGLang's pdmux, deterministic inference, EP).
_engine_checks: list[Callable[[], str | None]] = []
_workspaces: dict[tuple, object] = {}  # (device, E, top-k, H, I, activation) -> the first wrapper (owns the buffers)
_layers: dict[tuple, _Layer] = {}  # (config, the layer's weight pointers) -> its wrapper and scales


def engine_check(check: Callable[[], str | None]) -> Callable[[], None]:
    """Add `check() -> reason | None` (a setting of the serving engine under which b12x cannot serve); return its removal.

    An engine home adds its own at install() and removes it at uninstall(): nothing is added at import."""
    with _lock:
        _engine_checks.append(check)

    def remove() -> None:
        with _lock:
            if check in _engine_checks:
                _engine_checks.remove(check)

    return remove


def _wrapper_class() -> WrapperFactory:
    from flashinfer.fused_moe import B12xMoEWrapper  # exported only where the CuTe DSL imports

    return B12xMoEWrapper


def supported(device: Device) -> tuple[bool, str | None]:
    """Return whether b12x's MoE can serve on `device` in this process, and why not."""
    problem = toolchain_problem("b12x MoE", MIN_CUDA)
    if problem is None:
        with _lock:
            checks = list(_engine_checks)
        problem = next((r for r in (check() for check in checks) if r), None)
    # How many ranks serve the model with this process: torch.distributed's world size (1 where none), engine-neutral
    # until each engine home reports its TP/PP sizes (the world spans TP x PP (x DP) ranks).
    dist = torch.distributed
    ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if problem is None and ranks > 1:
        problem = (
            f"b12x MoE is refused with {ranks} ranks (torch.distributed world size {ranks}): {MULTI_RANK_ISSUE} "
            "reports garbage output at TP=2 / PP=2 while one GPU is correct, and no multi-rank check of it exists "
            "here yet; serve it on one GPU, or let cutlass serve"
        )
    if problem is None and tuple(device.capability) not in ((12, 0), (12, 1)):
        problem = f"b12x MoE runs on sm_120/sm_121 only (found sm_{device.sm})"
    if problem is not None:
        return False, problem
    ok, reason = moe_supported("cutlass", device)  # a real GPU, FlashInfer installed
    if not ok:
        return False, reason
    try:
        _wrapper_class()
    except Exception as exc:  # ImportError (no CuTe DSL), or a broken install raising anything
        return False, f"flashinfer {flashinfer_version()} has no B12xMoEWrapper: {type(exc).__name__}: {exc}"
    return True, None


def layer_problem(experts: int, hidden: int, inter: int, activation: str, dtype: torch.dtype) -> str | None:
    """Return why b12x cannot serve a layer of these sizes and dtype, or None."""
    if dtype != torch.bfloat16:
        return f"b12x MoE takes bf16 activations and output only (this layer: {str(dtype).removeprefix('torch.')})"
    if activation not in ACTIVATIONS:
        return f"b12x MoE serves SwiGLU without clamps and relu2 only (this layer: {activation})"
    if inter > MAX_INTER:
        return f"b12x MoE fails to launch on SM120 for I >= {MAX_INTER + 1} (FlashInfer #3807; this layer: I={inter})"
    if inter % INTER_ALIGN:
        return f"b12x MoE needs I % {INTER_ALIGN} == 0 (this layer: I={inter}; below it FlashInfer pads a private copy per layer)"
    if hidden % INTER_ALIGN and version_in(flashinfer_version(), HIDDEN_ALIGN_FROM):
        return f"b12x MoE in flashinfer {flashinfer_version()} needs H % {INTER_ALIGN} == 0 (this layer: H={hidden})"
    return None


def mma_scale_view(sf: torch.Tensor, rows: int, cols: int, experts: int) -> torch.Tensor:
    """Return the zero-copy 6-D MMA view (32, 4, m_tiles, 4, k_tiles, E) of per-expert swizzled block scales."""
    rp, cp = nvfp4.swizzled_scale_shape(rows, cols)
    return sf.reshape(experts, rp // 128, cp // 4, 32, 4, 4).permute(3, 4, 1, 5, 2, 0)


@dataclass
class _Derived:
    """One layer's scales in b12x's direction (it divides by global scales where cutlass multiplies)."""

    input_global_scale: torch.Tensor  # 1 / a1_gscale
    w1_alpha: torch.Tensor  # w13_alpha * a1_gscale
    fc2_input_scale: torch.Tensor  # 1 / a2_gscale
    w2_alpha: torch.Tensor
    source: tuple = ()  # the convention's (w13_alpha, w2_alpha, a1, a2) they were made from
    made: tuple = ()  # their (pointer, version) then

    def refresh(self, w13_alpha, w2_alpha, a1, a2) -> None:
        """Recompute in place (the same tensors: graphs captured earlier read the new values)."""
        torch.reciprocal(a1.float().reshape(self.input_global_scale.shape), out=self.input_global_scale)
        torch.mul(w13_alpha.float(), a1.float(), out=self.w1_alpha)
        torch.reciprocal(a2.float().reshape(self.fc2_input_scale.shape), out=self.fc2_input_scale)
        self.w2_alpha.copy_(w2_alpha.float())
        self.source = (w13_alpha, w2_alpha, a1, a2)
        self.made = _stamp(*self.source)


def _stamp(*tensors: torch.Tensor) -> tuple:
    return tuple((t.data_ptr(), t._version) for t in tensors)


@dataclass
class _Layer:
    wrapper: object
    derived: _Derived


def reset() -> bool:
    """Forget every wrapper and workspace (uninstall, a backend switch, tests); True: another backend can take over."""
    with _lock:
        _workspaces.clear()
        _layers.clear()
    return True


def _make_wrapper(config: tuple, owner: object | None) -> object:
    device, experts, top_k, hidden, inter, activation = config
    shared = {}
    if owner is not None:  # the configuration's buffers, never replaced
        names = ("shared_static_workspace", "shared_dynamic_workspace", "shared_output")
        shared = {name: getattr(owner, attr, None) for name, attr in zip(names, _BUFFERS)}
    shared.update(use_cuda_graph=True, max_num_tokens=MAX_TOKENS, output_dtype=torch.bfloat16, device=device)
    return _wrapper_class()(
        experts, top_k, hidden, inter, activation=ACTIVATIONS[activation], quant_mode="nvfp4", **shared
    )


def _layer(w13, w13_sf, w13_alpha, w2, w2_sf, w2_alpha, a1, a2, top_k: int, activation: str) -> _Layer:
    """Return the layer's wrapper and derived scales, made (with its configuration's workspace) at the first ask."""
    experts, hidden, inter = w13.shape[0], w13.shape[2] * 2, w2.shape[2] * 2
    config = (str(w13.device), experts, top_k, hidden, inter, activation)
    key = (config, w13.data_ptr(), w2.data_ptr(), w13_sf.data_ptr(), w2_sf.data_ptr())
    with _lock:
        entry = _layers.get(key)
        if entry is None:
            owner = _workspaces.get(config)
            wrapper = _make_wrapper(config, owner)
            _workspaces.setdefault(config, wrapper)
            made = (torch.empty(t.shape, dtype=torch.float32, device=t.device) for t in (a1, w13_alpha, a2, w2_alpha))
            entry = _layers[key] = _Layer(wrapper, _Derived(*made))
            entry.derived.refresh(w13_alpha, w2_alpha, a1, a2)
    if entry.derived.made != _stamp(w13_alpha, w2_alpha, a1, a2):  # the layer's scales changed (a weight update)
        entry.derived.refresh(w13_alpha, w2_alpha, a1, a2)
        _refold(entry)
    return entry


def _refold(entry: _Layer) -> None:
    """Refold the wrapper's FC1 alpha (w1_alpha * input_global_scale) in its own tensor, which graphs read."""
    folded = getattr(entry.wrapper, "_folded_w1_alpha", None)
    w1, scale = entry.derived.w1_alpha, entry.derived.input_global_scale
    if isinstance(folded, torch.Tensor) and folded.shape == w1.shape:
        torch.mul(w1, scale.reshape(-1) if scale.numel() > 1 else scale, out=folded)
        # FlashInfer's key for its fold (0.7.2-0.7.4): it then keeps this tensor instead of folding into a new one.
        entry.wrapper._folded_w1_alpha_key = (w1.data_ptr(), scale.data_ptr(), w1._version, scale._version)


def prepare(tensors: dict, keep_original: bool = False) -> None:
    """Make a served layer's wrapper and derived scales at load, and its configuration's workspace if new."""
    if "top_k" not in tensors or tensors.get("dtype") != torch.bfloat16:
        return  # the first call makes them (a layer b12x does not serve is refused there, by name)
    w13, w2 = tensors["w13"], tensors["w2"]
    activation = "swiglu" if w13.shape[1] == w2.shape[2] * 4 else "relu2"
    if layer_problem(w13.shape[0], w13.shape[2] * 2, w2.shape[2] * 2, activation, torch.bfloat16) is None:
        names = ("w13", "w13_sf", "w13_alpha", "w2", "w2_sf", "w2_alpha", "a1_gscale", "a2_gscale")
        _layer(*(tensors[n] for n in names), tensors["top_k"], activation)


def refresh_scales() -> None:
    """Recompute every layer's derived scales in place from its own (SGLang writes them without a version bump)."""
    with _lock:
        entries = list(_layers.values())
    for entry in entries:
        entry.derived.refresh(*entry.derived.source)
        _refold(entry)


def fused_moe(*args):
    """Run the MoE convention (MoeArgs) through b12x."""
    c = check_moe_args(*args)
    experts, rows, hidden = c.w13.shape[0], c.w13.shape[1], c.w13.shape[2] * 2
    inter = c.w2.shape[2] * 2
    problem = layer_problem(experts, hidden, inter, c.activation, c.x.dtype)
    if problem is not None:
        param = "x" if c.x.dtype != torch.bfloat16 else "w2"
        raise not_accepted("b12x fused MoE", param, getattr(c, param), problem)
    scales = (c.w13_alpha, c.w2, c.w2_sf, c.w2_alpha, c.a1_gscale, c.a2_gscale)
    entry = _layer(c.w13, c.w13_sf, *scales, c.topk_ids.shape[1], c.activation)
    d = entry.derived
    scales = dict(w1_alpha=d.w1_alpha, w2_alpha=d.w2_alpha, fc2_input_scale=d.fc2_input_scale)
    scales.update(input_global_scale=d.input_global_scale)
    w1_sf, w2_sf = mma_scale_view(c.w13_sf, rows, hidden, experts), mma_scale_view(c.w2_sf, hidden, inter, experts)
    ids = c.topk_ids if c.topk_ids.dtype == torch.int32 else c.topk_ids.to(torch.int32)
    for lo in range(0, c.x.shape[0], MAX_TOKENS):
        chunk = slice(lo, min(lo + MAX_TOKENS, c.x.shape[0]))
        result = entry.wrapper.run(c.x[chunk], c.w13, w1_sf, c.w2, w2_sf, ids[chunk], c.topk_weights[chunk], **scales)
        c.out[chunk].copy_(result)  # the wrapper returns a slice of its own output buffer
    return c.out


def _nbytes(obj: object, seen: set) -> int:
    """Return the bytes of the distinct tensor storages in `obj` (a tensor, dataclass, sequence or object)."""
    if isinstance(obj, torch.Tensor):
        size = obj.untyped_storage().nbytes() if obj.numel() else 0
        if (obj.data_ptr(), size) in seen:
            return 0
        seen.add((obj.data_ptr(), size))
        return size
    if is_dataclass(obj) and not isinstance(obj, type):
        return sum(_nbytes(getattr(obj, f.name), seen) for f in fields(obj))
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o, seen) for o in obj)
    if hasattr(obj, "__dict__") and not callable(obj):
        return sum(_nbytes(v, seen) for v in vars(obj).values())
    return 0


def describe() -> dict:
    """Return what status shows: each configuration's workspace (its bytes), and the layers served."""
    with _lock:
        workspaces = dict(_workspaces)
        layers = len(_layers)
    out = []
    for (device, experts, top_k, hidden, inter, activation), owner in workspaces.items():
        seen: set = set()
        config = f"E={experts} top_k={top_k} H={hidden} I={inter} {activation}"
        size = sum(_nbytes(getattr(owner, a, None), seen) for a in _BUFFERS)
        out.append({"device": device, "config": config, "max_tokens": MAX_TOKENS, "bytes": size})
    return {"workspaces": out, "layers": layers, "workspace_bytes": sum(w["bytes"] for w in out)}

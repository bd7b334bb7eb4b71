"""SGLang's real NVFP4 FusedMoE layer, built on this device from a checkpoint's expert tensors.

Used by ``sm120-fp4 selftest --model`` (:mod:`.model_check`: a checkpoint's own experts) and by
``sm120-fp4 demo`` (a synthetic checkpoint, :mod:`sm120_fp4.demo.synthetic`); the dense twin is
:mod:`.layers`. The layer is SGLang's own ``FusedMoE`` with ``ModelOptFp4Config``
(``ModelOptNvFp4FusedMoEMethod``) or with a compressed-tensors config
(``CompressedTensorsW4A4Nvfp4MoE``). The tensors go through SGLang's own ``FusedMoE.weight_loader``, so
the expert (EP) and intermediate (TP) slicing and the ``[up; gate]`` row order are SGLang's. Then
SGLang's ``process_weights_after_loading`` runs (where the patched hooks verify the layer), and
:func:`moe_forward` runs SGLang's forward.

Everything SGLang reads while building and running the layer comes from its own scoped seams,
held by :func:`sglang_moe_context` and undone on exit:

* ``runtime_context.override_platform``: the SM120 facts (``is_blackwell`` is required by both NVFP4
  MoE methods; ``is_sm120`` steers server-args resolution of ``auto``);
* ``runtime_context.create_context`` + ``use_context``: a model-owned runtime context built from
  ``ServerArgs`` for a throw-away local model directory (a ``config.json`` only), so nothing is
  published process-wide;
* ``get_parallel().override``: one simulated rank (no torch.distributed);
* ``moe.utils.initialize_moe_config()``: the MoE flags, written into that context's flags.

What this module does not do: replace the kernel. The forward reaches
``sglang.srt.layers.moe.moe_runner.flashinfer_cutlass._flashinfer_cutlass_fused_moe()`` (FlashInfer's
``cutlass_fused_moe``), which raises without CUDA; whoever runs a forward installs the backend
there (the library's verified routing, or a test's stand-in). What a layer must compute, from the
checkpoint alone, is :func:`sm120_fp4.demo.synthetic.reference_moe_output` (through
:func:`sm120_fp4.nvfp4.reference_moe_fp4`).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import tempfile
import weakref
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch

from .. import locks
from ..errors import ConfigError, InvalidArgument, check_ranks, not_accepted

__all__ = [
    "SEAMS",
    "builder_problem",
    "MoeContext",
    "sglang_moe_context",
    "active_moe_context",
    "build_modelopt_moe_layer",
    "build_moe_layer_from_tensors",
    "moe_forward",
    "MODELOPT",
    "COMPRESSED_TENSORS",
]

# The scoped seams above are SGLang's runtime context (override_platform, create_context,
# use_context, get_parallel().override): 0.5.22 and 0.5.23 have all of them, 0.5.20 has
# override_platform only, 0.5.15-0.5.18 none (they keep platform and parallel state in process
# globals that cannot be scoped on a CPU). Where one is missing no simulated FusedMoE layer is built;
# the fused-MoE seam and the MoE weights hooks still apply there when served.
SEAMS = ("override_platform", "create_context", "use_context", "get_parallel")


def builder_problem() -> str | None:
    """Why this SGLang cannot build a simulated MoE layer here (a scoped seam it lacks), or None."""
    from .release import RUNTIME_CONTEXT, sglang_version

    try:
        module = importlib.import_module(RUNTIME_CONTEXT)
    except Exception as exc:
        return f"SGLang {sglang_version()}: {RUNTIME_CONTEXT} does not import ({type(exc).__name__}: {exc})"
    missing = [name for name in SEAMS if not hasattr(module, name)]
    if missing:
        return (
            f"building SGLang's FusedMoE on a CPU needs its scoped runtime seams ({', '.join(SEAMS)}); "
            f"SGLang {sglang_version()}'s runtime_context lacks {', '.join(missing)}"
        )
    return None


MODELOPT = "modelopt_fp4"  # SGLang's --quantization name
COMPRESSED_TENSORS = "compressed-tensors"  # named by a checkpoint's config.json only
_QUANTIZATIONS = (MODELOPT, COMPRESSED_TENSORS)
_FORMATS = {"modelopt": MODELOPT, "compressed-tensors": COMPRESSED_TENSORS}  # sm120_fp4.checkpoints' names
_ACTIVATIONS = {"swiglu": ("silu", True), "relu2": ("relu2", False)}  # ours -> (SGLang's activation, is_gated)
_PREFIX = "model.layers.0.mlp.experts"  # the layer's name in the (imaginary) model
_SM120_FACTS = {
    "is_blackwell": True,
    "is_sm120": True,
    "is_sm100": False,
    "is_sm100_or_sm110": False,
    "is_sm110": False,
    "device_capability": (12, 0),
    "device_sm": 120,
}
# The compressed-tensors (llm-compressor) NVFP4 W4A4 recipe: what selects CompressedTensorsW4A4Nvfp4MoE.
_CT_QUANT_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "nvfp4-pack-quantized",
    "ignore": ["lm_head"],
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "float",
                "strategy": "tensor_group",
                "group_size": 16,
                "symmetric": True,
                "dynamic": False,
            },
            "input_activations": {
                "num_bits": 4,
                "type": "float",
                "strategy": "tensor_group",
                "group_size": 16,
                "symmetric": True,
                "dynamic": "local",
            },
        }
    },
}
_MODELOPT_QUANT_CONFIG = {
    "quant_method": "modelopt",
    "quant_algo": "NVFP4",
    "group_size": 16,
    "kv_cache_quant_algo": None,
    "exclude_modules": ["lm_head"],
}


# --------------------------------------------------------------------------------------------
# SGLang's scoped seams
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Settings:
    moe_runner_backend: str
    quantization: str
    ep_size: int
    ep_rank: int
    tp_size: int
    tp_rank: int


@dataclass
class MoeContext:
    """What :func:`sglang_moe_context` holds while it is active."""

    moe_runner_backend: str
    quantization: str
    ep_size: int
    ep_rank: int
    tp_size: int
    tp_rank: int
    model_dir: str  # the throw-away model directory (config.json only); deleted on exit
    server_args: Any  # SGLang's ServerArgs, resolved
    runtime_context: Any  # SGLang's RuntimeContext, active while the context is

    def settings(self) -> _Settings:
        return _Settings(
            self.moe_runner_backend, self.quantization, self.ep_size, self.ep_rank, self.tp_size, self.tp_rank
        )


_ACTIVE: list[MoeContext] = []  # innermost last; SGLang's use_context is process-global too
_LOCK = locks.rlock()  # serializes the scopes: SGLang's seams are process globals
_LAYER_SETTINGS: "weakref.WeakKeyDictionary[torch.nn.Module, _Settings]" = weakref.WeakKeyDictionary()


def active_moe_context() -> MoeContext | None:
    """The innermost active :func:`sglang_moe_context`, or None."""
    return _ACTIVE[-1] if _ACTIVE else None


def _write_model_dir(root: str, quantization: str) -> str:
    """A local model directory SGLang's ModelConfig reads without the hub (config.json only).

    Its sizes are placeholders: they only feed server-args resolution, never the layer, whose sizes
    come from the checkpoint. The quantization config is what a real export carries.
    """
    quant = _MODELOPT_QUANT_CONFIG if quantization == MODELOPT else _CT_QUANT_CONFIG
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 256,
        "moe_intermediate_size": 128,
        "intermediate_size": 1024,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 1024,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "hidden_act": "silu",
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "quantization_config": quant,
    }
    path = os.path.join(root, "model")
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return path


@contextlib.contextmanager
def _environ_restored() -> Iterator[None]:
    """Undo any environment variable SGLang's server-args resolution sets while the scope is open."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        for key in set(os.environ) - set(saved):
            del os.environ[key]
        for key, value in saved.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


@contextlib.contextmanager
def sglang_moe_context(
    moe_runner_backend: str = "flashinfer_cutlass",
    *,
    ep_size: int = 1,
    ep_rank: int = 0,
    tp_size: int = 1,
    tp_rank: int = 0,
    quantization: str = MODELOPT,
    server_args: dict | None = None,
) -> Iterator[MoeContext]:
    """Hold SGLang's scoped seams for building and running one simulated rank's MoE layers.
    `server_args`: more ServerArgs fields (e.g. chunked_prefill_size), as a server would be started with.

    In order: ``override_platform`` (SM120 facts), ``ServerArgs`` for a throw-away local model
    directory whose ``config.json`` carries `quantization`'s config ("modelopt_fp4", also passed as
    ``--quantization``; or "compressed-tensors", named by config.json only, as SGLang resolves such a
    checkpoint: SGLang refuses ``--quantization compressed-tensors`` with flashinfer_cutlass, so use
    ``moe_runner_backend="auto"`` there, with which the scheme itself picks FLASHINFER_CUTLASS),
    ``create_context(role="scheduler")`` + ``use_context``,
    ``get_parallel().override`` for rank ``(ep_rank, tp_rank)`` of an ``ep_size * tp_size`` group
    (SGLang's layout: group rank ``ep_rank * tp_size + tp_rank``; attention TP spans the group), and
    ``initialize_moe_config()`` (which writes into that context's own flags). Everything is restored
    on exit, by SGLang's own scope exits (the previous runtime context by identity, the parallel and
    platform overrides as they were), the model directory is deleted, and any environment variable
    the server-args resolution set is undone. Nested contexts are allowed; they are process-global,
    like SGLang's ``use_context``, so a lock serializes threads.
    """
    check_ranks("sglang_moe_context", ep_size, ep_rank, tp_size, tp_rank)
    if quantization not in _QUANTIZATIONS:
        raise not_accepted("sglang_moe_context", "quantization", quantization, f"one of {_QUANTIZATIONS}")
    from sglang.srt import runtime_context as rc
    from sglang.srt.layers.moe import utils as moe_utils
    from sglang.srt.server_args import ServerArgs

    known = set(getattr(rc, "_PLATFORM_PROBES", {})) | set(getattr(rc, "_PLATFORM_VALUES", {}))
    facts = {k: v for k, v in _SM120_FACTS.items() if not known or k in known}
    world, rank = ep_size * tp_size, ep_rank * tp_size + tp_rank
    with _LOCK, contextlib.ExitStack() as stack:
        root = stack.enter_context(tempfile.TemporaryDirectory(prefix="sm120_fp4_moe_"))
        model_dir = _write_model_dir(root, quantization)
        stack.enter_context(_environ_restored())
        stack.enter_context(rc.override_platform(**facts))
        # compressed-tensors is named by config.json only (as SGLang resolves such a checkpoint);
        # SGLang refuses an explicit --quantization compressed-tensors with flashinfer_cutlass.
        server_args = ServerArgs(
            model_path=model_dir,
            moe_runner_backend=moe_runner_backend,
            device="cpu",
            skip_tokenizer_init=True,
            quantization=quantization if quantization == MODELOPT else None,
            **(server_args or {}),
        )
        context = rc.create_context(server_args, role="scheduler")
        stack.enter_context(rc.use_context(context))
        stack.enter_context(
            rc.get_parallel().override(
                tp_size=world,
                tp_rank=rank,
                attn_tp_size=world,
                attn_tp_rank=rank,
                moe_ep_size=ep_size,
                moe_ep_rank=ep_rank,
                moe_tp_size=tp_size,
                moe_tp_rank=tp_rank,
                tp_group=None,
            )
        )
        moe_utils.initialize_moe_config()
        handle = MoeContext(
            moe_runner_backend, quantization, ep_size, ep_rank, tp_size, tp_rank, model_dir, server_args, context
        )
        _ACTIVE.append(handle)
        try:
            yield handle
        finally:
            _ACTIVE.remove(handle)


@contextlib.contextmanager
def _context_for(settings: _Settings, *, strict: bool) -> Iterator[MoeContext]:
    """The active context when it has `settings`' quantization and ranks; else a fresh one with them.

    ``strict``: an active context with other ranks or quantization is an error (the caller asked for
    a layer the active context cannot build) instead of being shadowed.
    """
    with _LOCK:
        active = active_moe_context()
        if active is not None:
            mine = active.settings()
            same = (mine.quantization, mine.ep_size, mine.ep_rank, mine.tp_size, mine.tp_rank) == (
                settings.quantization,
                settings.ep_size,
                settings.ep_rank,
                settings.tp_size,
                settings.tp_rank,
            )
            if same:
                yield active
                return
            if strict:
                raise InvalidArgument(
                    f"the active sglang_moe_context is {mine}; this call asks for quantization="
                    f"{settings.quantization!r}, ep_size={settings.ep_size}, ep_rank={settings.ep_rank}, "
                    f"tp_size={settings.tp_size}, tp_rank={settings.tp_rank}: pass the context's values, "
                    "or call it outside the context"
                )
        with sglang_moe_context(
            settings.moe_runner_backend,
            ep_size=settings.ep_size,
            ep_rank=settings.ep_rank,
            tp_size=settings.tp_size,
            tp_rank=settings.tp_rank,
            quantization=settings.quantization,
        ) as fresh:
            yield fresh


# --------------------------------------------------------------------------------------------
# Building the real layer
# --------------------------------------------------------------------------------------------


def _load_into(layer, ckpt, tensors: Mapping[str, torch.Tensor]) -> int:
    """Every checkpoint tensor through SGLang's FusedMoE.weight_loader, as a model's load_weights does."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    if ckpt.gated:
        mapping = FusedMoE.make_expert_params_mapping("gate_proj", "down_proj", "up_proj", ckpt.num_experts)
    else:  # nemotron_h's non-gated experts: the up projection is shard w1, and there is no w3
        mapping = FusedMoE.make_expert_params_mapping("up_proj", "down_proj", "", ckpt.num_experts)
    params = dict(layer.named_parameters())
    loaded = 0
    for name, tensor in tensors.items():
        for param_prefix, weight_prefix, expert_id, shard_id in mapping:
            if not name.startswith(weight_prefix):
                continue
            param_name = name.replace(weight_prefix, param_prefix).removeprefix("experts.")
            param = params.get(param_name)
            if param is None:
                raise InvalidArgument(
                    f"tensors: {name!r} maps to the parameter {param_name!r}, which this "
                    f"{type(layer.quant_method).__name__} layer does not have; expected the "
                    "format's own tensor kinds"
                )
            param.weight_loader(
                param, tensor, f"{_PREFIX.rsplit('.', 1)[0]}.{name}", shard_id=shard_id, expert_id=expert_id
            )
            loaded += 1
            break
        else:
            raise InvalidArgument(
                f"tensors: {name!r} matches no expert parameter of this layer; expected "
                "names experts.{e}.{gate_proj|up_proj|down_proj}.{kind}"
            )
    return loaded


def _build(ckpt, top_k: int, dtype: torch.dtype, settings: _Settings, make_quant_config, func: str):
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= ckpt.num_experts:
        raise not_accepted(func, "top_k", top_k, f"an int in [1, {ckpt.num_experts}] (the layer's experts)")
    check_ranks(func, settings.ep_size, settings.ep_rank, settings.tp_size, settings.tp_rank)
    if ckpt.num_experts % settings.ep_size:
        raise not_accepted(func, "ep_size", settings.ep_size, f"a divisor of the layer's {ckpt.num_experts} experts")
    if ckpt.intermediate % settings.tp_size:
        raise not_accepted(
            func, "tp_size", settings.tp_size, f"a divisor of the layer's intermediate size {ckpt.intermediate}"
        )
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    sglang_activation, is_gated = _ACTIVATIONS[ckpt.activation]
    with _context_for(settings, strict=True) as ctx:
        quant_config, tensors = make_quant_config(ckpt)
        with torch.no_grad():
            layer = FusedMoE(
                num_experts=ckpt.num_experts,
                hidden_size=ckpt.hidden,
                intermediate_size=ckpt.intermediate,
                layer_id=0,
                top_k=top_k,
                params_dtype=dtype,
                quant_config=quant_config,
                prefix=_PREFIX,
                activation=sglang_activation,
                is_gated=is_gated,
            )
            _load_into(layer, ckpt, tensors)
            layer.quant_method.process_weights_after_loading(layer)
        _LAYER_SETTINGS[layer] = ctx.settings()
    return layer


def build_modelopt_moe_layer(
    ckpt,
    top_k: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    ep_size: int = 1,
    ep_rank: int = 0,
    tp_size: int = 1,
    tp_rank: int = 0,
):
    """SGLang's FusedMoE + ModelOptFp4Config for a synthetic checkpoint (the demo's layer).

    `ckpt` is a :class:`sm120_fp4.demo.synthetic.MoeCheckpoint` (sizes, ``activation`` and its
    ModelOpt ``tensors()``): :func:`build_moe_layer_from_tensors` with ``fmt="modelopt"``.
    """
    return build_moe_layer_from_tensors(
        ckpt,
        ckpt.tensors(),
        top_k,
        fmt="modelopt",
        dtype=dtype,
        ep_size=ep_size,
        ep_rank=ep_rank,
        tp_size=tp_size,
        tp_rank=tp_rank,
    )


def build_moe_layer_from_tensors(
    spec,
    tensors: Mapping[str, torch.Tensor],
    top_k: int,
    *,
    fmt: str,
    dtype: torch.dtype = torch.bfloat16,
    ep_size: int = 1,
    ep_rank: int = 0,
    tp_size: int = 1,
    tp_rank: int = 0,
):
    """SGLang's FusedMoE for rank (ep_rank, tp_rank) of a checkpoint's experts, on the default device.

    `spec` has ``num_experts``, ``hidden``, ``intermediate``, ``gated`` and ``activation``; `tensors` are
    named ``experts.{e}.{gate_proj|up_proj|down_proj}.{kind}`` with the format's own kinds and values
    (ModelOpt: weight, weight_scale, weight_scale_2, input_scale; compressed-tensors: weight_packed,
    weight_scale, weight_global_scale, input_global_scale); `fmt` ("modelopt" or "compressed-tensors",
    :mod:`sm120_fp4.checkpoints`' names) picks SGLang's quantization method, as the checkpoint's config
    does. The tensors go through SGLang's own ``weight_loader`` (it keeps this rank's experts and
    I-slice, and writes w13 as ``[up; gate]``), then ``quant_method.process_weights_after_loading(layer)``
    runs. `dtype` is the model's activation dtype (SGLang's params_dtype).

    Inside an active :func:`sglang_moe_context` with the same ranks and quantization the layer is built
    there (with that context's runner backend); an active context with other ranks or quantization is
    an InvalidArgument; with none active, ``sglang_moe_context("flashinfer_cutlass", ...)`` (ModelOpt) or
    ``sglang_moe_context("auto", quantization="compressed-tensors", ...)`` is held for the build.

    SGLang's compressed-tensors config picks the W4A4 scheme by asking
    ``torch.cuda.get_device_capability()`` directly, which no SGLang seam reaches (and which raises
    without CUDA). The config *instance* built here answers that one question from SGLang's own
    platform facts (``get_platform().device_capability``: SM120 in the context, as for everything
    else SGLang reads while building) instead; no global is touched. That scheme is gated only
    (SGLang's ``create_weights`` always makes ``2 * I`` rows), so non-gated experts are an InvalidArgument.
    """
    func = "build_moe_layer_from_tensors"
    if fmt not in _FORMATS:
        raise not_accepted(func, "fmt", fmt, f"one of {tuple(_FORMATS)}")
    activation = getattr(spec, "activation", None)
    if activation not in _ACTIVATIONS:
        raise not_accepted(func, "spec.activation", activation, f"one of {tuple(_ACTIVATIONS)}")
    quantization = _FORMATS[fmt]
    if quantization == MODELOPT:
        from sglang.srt.layers.quantization.modelopt_quant import ModelOptFp4Config

        def quant(_spec):
            return ModelOptFp4Config(is_checkpoint_nvfp4_serialized=True, group_size=16), tensors

        backend = _default_backend()
    else:
        if not spec.gated:
            raise not_accepted(
                func,
                "spec",
                f"{activation} (non-gated) experts",
                "gated (swiglu) experts: CompressedTensorsW4A4Nvfp4MoE has no other",
            )
        from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

        def quant(_spec):
            config = CompressedTensorsConfig.from_config(json.loads(json.dumps(_CT_QUANT_CONFIG)))
            config._check_scheme_supported = _platform_scheme_check
            return config, tensors

        backend = _default_backend("auto")
    settings = _Settings(backend, quantization, ep_size, ep_rank, tp_size, tp_rank)
    return _build(spec, top_k, dtype, settings, quant, func)


def _platform_scheme_check(min_capability: int, error: bool = True) -> bool:
    """CompressedTensorsConfig._check_scheme_supported, answered from SGLang's platform facts."""
    from sglang.srt.runtime_context import get_platform

    major, minor = get_platform().device_capability
    supported = major * 10 + minor >= min_capability
    if error and not supported:
        raise ConfigError(
            f"the checkpoint's compressed-tensors scheme needs capability >= {min_capability}; "
            f"SGLang's platform is {major * 10 + minor}"
        )
    return supported


def _default_backend(default: str = "flashinfer_cutlass") -> str:
    active = active_moe_context()
    return active.moe_runner_backend if active is not None else default


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------


def moe_forward(layer, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """SGLang's forward of `layer`: ``layer(x, StandardTopKOutput(weights, ids, None))``, no grad.

    The TopK output is what SGLang's ``build_precomputed_topk_output`` wraps a router's own
    (weights, ids) in (minus its routed-experts capture and distribution recorder, process-global
    observers a bare layer has no use for): ``topk_weights`` float32 (T, k) and ``topk_ids`` int32
    (T, k) global expert ids, ``router_logits`` None (STANDARD consumers read only ids and weights).
    It runs inside the context the layer was built in (the active one if it has the layer's ranks
    and quantization, else a fresh one with them). The returned (T, H) is this rank's partial output:
    SGLang all-reduces it over the group afterwards (``FusedMoE`` is built with
    ``reduce_results=False`` here, so nothing is reduced).
    """
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    settings = _LAYER_SETTINGS.get(layer)
    if settings is None:
        raise not_accepted(
            "moe_forward",
            "layer",
            type(layer).__name__,
            "a layer made by build_moe_layer_from_tensors or build_modelopt_moe_layer",
        )
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise not_accepted(
            "moe_forward",
            "topk_ids",
            topk_ids,
            f"(T={x.shape[0]}, k), the shape of topk_weights {tuple(topk_weights.shape)}",
        )
    topk = StandardTopKOutput(topk_weights.to(torch.float32), topk_ids.to(torch.int32), None)
    with _context_for(settings, strict=False), torch.no_grad():
        return layer(x, topk)

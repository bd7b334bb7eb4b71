"""Build SGLang's real NVFP4 FusedMoE layer from a checkpoint's expert tensors, and run it (selftest --model, demo).

The tensors go through SGLang's own weight_loader and process_weights_after_loading (where the hooks verify),
inside SGLang's scoped runtime seams (:func:`sglang_moe_context`), undone on exit.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
from .release import RUNTIME_CONTEXT, platform_facts, sglang_version

# SGLang's runtime-context seams: 0.5.22+ have all, 0.5.20 override_platform only, 0.5.15-0.5.18 none
# (process globals that cannot be scoped on a CPU); there no simulated FusedMoE layer is built.
SEAMS = ("override_platform", "create_context", "use_context", "get_parallel")
MODELOPT = "modelopt_fp4"  # SGLang's --quantization name
COMPRESSED_TENSORS = "compressed-tensors"  # named by a checkpoint's config.json only
_FORMATS = {"modelopt": MODELOPT, "compressed-tensors": COMPRESSED_TENSORS}  # sm120_fp4.checkpoints' names
_ACTIVATIONS = {"swiglu": ("silu", True), "relu2": ("relu2", False)}  # ours -> (SGLang's activation, is_gated)
_PREFIX = "model.layers.0.mlp.experts"  # the layer's name in the (imaginary) model
_FP4 = dict(
    num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True, dynamic=False, observer="minmax"
)
_GROUP = dict(
    targets=["Linear"], weights=_FP4, format="nvfp4-pack-quantized", input_activations={**_FP4, "dynamic": "local"}
)
# Each format's quantization_config, as ModelOpt's and llm-compressor's NVFP4 exports write it.
QUANT_CONFIGS = {
    "modelopt": {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "group_size": 16,
        "kv_cache_quant_algo": None,
        "ignore": ["lm_head"],
        "producer": {"name": "sm120_fp4", "version": "demo"},
    },
    "compressed-tensors": {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": _GROUP},
        "ignore": ["lm_head", "re:.*mlp.gate$"],
        "kv_cache_scheme": None,
    },
}
# A tiny Qwen3-MoE's config.json (the demo's checkpoint; the placeholder model of sglang_moe_context).
TINY_MODEL_CONFIG = (
    dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", torch_dtype="bfloat16", dtype="bfloat16")
    | dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_experts=8, num_local_experts=8)
    | dict(num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=2)
    | dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=2048)
    | dict(rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="silu", tie_word_embeddings=False, bos_token_id=256)
    | dict(eos_token_id=257, attention_bias=False, output_router_logits=False, router_aux_loss_coef=0.0)
)


def builder_problem() -> str | None:
    """Return why this SGLang cannot build a simulated MoE layer here (a scoped seam it lacks), or None."""
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


@dataclass(frozen=True)
class _Settings:
    moe_runner_backend: str
    quantization: str
    ep_size: int
    ep_rank: int
    tp_size: int
    tp_rank: int


@dataclass(frozen=True)
class MoeContext(_Settings):
    """Hold what :func:`sglang_moe_context` made while it is active."""

    model_dir: str  # the throw-away model directory (config.json only); deleted on exit
    server_args: Any  # SGLang's ServerArgs, resolved
    runtime_context: Any  # SGLang's RuntimeContext, active while the context is

    def settings(self) -> _Settings:
        return _Settings(*(getattr(self, f.name) for f in dataclasses.fields(_Settings)))


_ACTIVE: list[MoeContext] = []  # innermost last; SGLang's use_context is process-global too
_LOCK = locks.rlock()  # serializes the scopes: SGLang's seams are process globals
_LAYER_SETTINGS: "weakref.WeakKeyDictionary[torch.nn.Module, _Settings]" = weakref.WeakKeyDictionary()


def active_moe_context() -> MoeContext | None:
    """Return the innermost active :func:`sglang_moe_context`, or None."""
    return _ACTIVE[-1] if _ACTIVE else None


def _write_model_dir(root: str, quantization: str) -> str:
    """Write a local model directory (config.json only) for SGLang's ModelConfig; its sizes only feed server args."""
    fmt = next(f for f, q in _FORMATS.items() if q == quantization)
    path = os.path.join(root, "model")
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**TINY_MODEL_CONFIG, "quantization_config": QUANT_CONFIGS[fmt]}, f, indent=1)
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
    """Hold SGLang's scoped seams (SM120 platform, runtime context, one simulated rank, MoE flags) until exit."""
    check_ranks("sglang_moe_context", ep_size, ep_rank, tp_size, tp_rank)
    if quantization not in _FORMATS.values():
        raise not_accepted("sglang_moe_context", "quantization", quantization, f"one of {tuple(_FORMATS.values())}")
    from sglang.srt import runtime_context as rc
    from sglang.srt.layers.moe import utils as moe_utils
    from sglang.srt.server_args import ServerArgs

    with _LOCK, contextlib.ExitStack() as stack:
        root = stack.enter_context(tempfile.TemporaryDirectory(prefix="sm120_fp4_moe_"))
        model_dir = _write_model_dir(root, quantization)
        stack.enter_context(_environ_restored())
        stack.enter_context(rc.override_platform(**platform_facts(rc, (12, 0))))
        # compressed-tensors is named by config.json only: SGLang refuses it explicit with flashinfer_cutlass.
        quant = quantization if quantization == MODELOPT else None
        fixed = dict(device="cpu", quantization=quant, skip_tokenizer_init=True)
        args = ServerArgs(model_path=model_dir, moe_runner_backend=moe_runner_backend, **fixed, **(server_args or {}))
        context = rc.create_context(args, role="scheduler")
        stack.enter_context(rc.use_context(context))
        # Group rank ep_rank * tp_size + tp_rank (attention TP: the group).
        world, rank = ep_size * tp_size, ep_rank * tp_size + tp_rank
        moe = dict(moe_ep_size=ep_size, moe_ep_rank=ep_rank, moe_tp_size=tp_size, moe_tp_rank=tp_rank)
        parallel = dict(tp_size=world, tp_rank=rank, attn_tp_size=world, attn_tp_rank=rank, **moe, tp_group=None)
        stack.enter_context(rc.get_parallel().override(**parallel))
        moe_utils.initialize_moe_config()  # writes into the context's own flags
        handle = MoeContext(
            moe_runner_backend, quantization, ep_size, ep_rank, tp_size, tp_rank, model_dir, args, context
        )
        _ACTIVE.append(handle)
        try:
            yield handle
        finally:
            _ACTIVE.remove(handle)


@contextlib.contextmanager
def _context_for(settings: _Settings, *, strict: bool) -> Iterator[MoeContext]:
    """Use the active context if it has `settings`' quantization and ranks, else (unless `strict`) a fresh one."""
    with _LOCK:
        active = active_moe_context()
        if active is not None:
            mine = active.settings()
            if dataclasses.replace(mine, moe_runner_backend=settings.moe_runner_backend) == settings:
                yield active
                return
            if strict:
                raise InvalidArgument(
                    f"the active sglang_moe_context is {mine}; this call asks for quantization="
                    f"{settings.quantization!r}, ep_size={settings.ep_size}, ep_rank={settings.ep_rank}, "
                    f"tp_size={settings.tp_size}, tp_rank={settings.tp_rank}: pass the context's values, "
                    "or call it outside the context"
                )
        fields = dataclasses.asdict(settings)
        with sglang_moe_context(fields.pop("moe_runner_backend"), **fields) as fresh:
            yield fresh


def _load_into(layer, spec, tensors: Mapping[str, torch.Tensor]) -> None:
    """Load every checkpoint tensor through SGLang's FusedMoE.weight_loader, as a model's load_weights does."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    # nemotron_h's non-gated experts: the up projection is shard w1, and there is no w3
    up_gate = ("gate_proj", "down_proj", "up_proj") if spec.gated else ("up_proj", "down_proj", "")
    mapping = FusedMoE.make_expert_params_mapping(*up_gate, spec.num_experts)
    params = dict(layer.named_parameters())
    for name, tensor in tensors.items():
        match = next((m for m in mapping if name.startswith(m[1])), None)
        if match is None:
            raise InvalidArgument(
                f"tensors: {name!r} matches no expert parameter of this layer; expected "
                "names experts.{e}.{gate_proj|up_proj|down_proj}.{kind}"
            )
        param_prefix, weight_prefix, expert_id, shard_id = match
        param_name = name.replace(weight_prefix, param_prefix).removeprefix("experts.")
        param = params.get(param_name)
        if param is None:
            raise InvalidArgument(
                f"tensors: {name!r} maps to the parameter {param_name!r}, which this "
                f"{type(layer.quant_method).__name__} layer does not have; expected the format's own tensor kinds"
            )
        prefix = _PREFIX.rsplit(".", 1)[0]
        param.weight_loader(param, tensor, f"{prefix}.{name}", shard_id=shard_id, expert_id=expert_id)


def _check_build(spec, top_k: int, settings: _Settings, func: str) -> None:
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= spec.num_experts:
        raise not_accepted(func, "top_k", top_k, f"an int in [1, {spec.num_experts}] (the layer's experts)")
    check_ranks(func, settings.ep_size, settings.ep_rank, settings.tp_size, settings.tp_rank)
    if spec.num_experts % settings.ep_size:
        raise not_accepted(func, "ep_size", settings.ep_size, f"a divisor of the layer's {spec.num_experts} experts")
    if spec.intermediate % settings.tp_size:
        why = f"a divisor of the layer's intermediate size {spec.intermediate}"
        raise not_accepted(func, "tp_size", settings.tp_size, why)


def _quant_config(quantization: str):
    if quantization == MODELOPT:
        from sglang.srt.layers.quantization.modelopt_quant import ModelOptFp4Config

        return ModelOptFp4Config(is_checkpoint_nvfp4_serialized=True, group_size=16)
    from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    config = CompressedTensorsConfig.from_config(json.loads(json.dumps(QUANT_CONFIGS["compressed-tensors"])))
    # Its W4A4 scheme asks torch.cuda directly (no SGLang seam): this instance asks SGLang's platform facts.
    config._check_scheme_supported = _platform_scheme_check
    return config


_CLAMPS = ("swiglu_limit", "gemm1_alpha", "gemm1_clamp_limit")  # FusedMoE's SwiGLU clamp arguments (a model's config)


def build_modelopt_moe_layer(ckpt, top_k: int, *, dtype: torch.dtype = torch.bfloat16, **ranks):
    """Return SGLang's FusedMoE + ModelOptFp4Config for a :class:`sm120_fp4.demo.synthetic.MoeCheckpoint`."""
    return build_moe_layer_from_tensors(ckpt, ckpt.tensors(), top_k, fmt="modelopt", dtype=dtype, **ranks)


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
    """Return SGLang's FusedMoE for rank (ep_rank, tp_rank) of `spec`'s `tensors` (``experts.{e}.{proj}.{kind}``)."""
    # `spec`: num_experts, hidden, intermediate, gated, activation; uses the active sglang_moe_context or holds one.
    func = "build_moe_layer_from_tensors"
    if fmt not in _FORMATS:
        raise not_accepted(func, "fmt", fmt, f"one of {tuple(_FORMATS)}")
    activation = getattr(spec, "activation", None)
    if activation not in _ACTIVATIONS:
        raise not_accepted(func, "spec.activation", activation, f"one of {tuple(_ACTIVATIONS)}")
    quantization = _FORMATS[fmt]
    if quantization == COMPRESSED_TENSORS and not spec.gated:  # SGLang's create_weights makes 2 * I rows
        why = "gated (swiglu) experts: CompressedTensorsW4A4Nvfp4MoE has no other"
        raise not_accepted(func, "spec", f"{activation} (non-gated) experts", why)
    active = active_moe_context()
    default = "flashinfer_cutlass" if quantization == MODELOPT else "auto"
    backend = active.moe_runner_backend if active is not None else default
    settings = _Settings(backend, quantization, ep_size, ep_rank, tp_size, tp_rank)
    _check_build(spec, top_k, settings, func)
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    act, is_gated = _ACTIVATIONS[activation]
    sizes = dict(
        num_experts=spec.num_experts, hidden_size=spec.hidden, intermediate_size=spec.intermediate, top_k=top_k
    )
    how = dict(params_dtype=dtype, activation=act, is_gated=is_gated, layer_id=0, prefix=_PREFIX)
    clamps = {k: getattr(spec, k) for k in _CLAMPS if getattr(spec, k, None) is not None}  # the model's, as it passes
    with _context_for(settings, strict=True) as ctx:
        with torch.no_grad():
            layer = FusedMoE(**sizes, **how, **clamps, quant_config=_quant_config(quantization))
            _load_into(layer, spec, tensors)
            layer.quant_method.process_weights_after_loading(layer)
        _LAYER_SETTINGS[layer] = ctx.settings()
    return layer


def _platform_scheme_check(min_capability: int, error: bool = True) -> bool:
    """Answer CompressedTensorsConfig._check_scheme_supported from SGLang's platform facts."""
    from sglang.srt.runtime_context import get_platform

    major, minor = get_platform().device_capability
    supported = major * 10 + minor >= min_capability
    if error and not supported:
        raise ConfigError(
            f"the checkpoint's compressed-tensors scheme needs capability >= {min_capability}; "
            f"SGLang's platform is {major * 10 + minor}"
        )
    return supported


def moe_forward(layer, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Return this rank's partial (T, H) output of SGLang's forward of `layer` for global `topk_ids`, no grad."""
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    settings = _LAYER_SETTINGS.get(layer)
    if settings is None:
        why = "a layer made by build_moe_layer_from_tensors or build_modelopt_moe_layer"
        raise not_accepted("moe_forward", "layer", type(layer).__name__, why)
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        why = f"(T={x.shape[0]}, k), the shape of topk_weights {tuple(topk_weights.shape)}"
        raise not_accepted("moe_forward", "topk_ids", topk_ids, why)
    # As SGLang's build_precomputed_topk_output wraps (weights, ids), without its process-global observers.
    topk = StandardTopKOutput(topk_weights.to(torch.float32), topk_ids.to(torch.int32), None)
    with _context_for(settings, strict=False), torch.no_grad():
        return layer(x, topk)

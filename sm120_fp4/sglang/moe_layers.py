"""Real SGLang NVFP4 MoE layers built from synthetic checkpoints: the MoE twin of :mod:`.layers`.

The layer is SGLang's own ``FusedMoE`` with ``ModelOptFp4Config`` (``ModelOptNvFp4FusedMoEMethod``)
or with a compressed-tensors config (``CompressedTensorsW4A4Nvfp4MoE``). The checkpoint, made with
:mod:`sm120_fp4.nvfp4` in ModelOpt's format, goes through SGLang's own ``FusedMoE.weight_loader``, so
the expert (EP) and intermediate (TP) slicing and the ``[up; gate]`` row order are SGLang's. Then
SGLang's ``process_weights_after_loading`` runs, and :func:`moe_forward` runs SGLang's forward.

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
there (the library's verified routing, or a test's stand-in).

Numbers: :func:`reference_moe_output` is what a layer must compute, from the checkpoint alone,
through :func:`sm120_fp4.nvfp4.reference_moe_fp4`; :func:`moe_weights` is what SGLang hands the
kernel, in ``reference_moe_fp4``'s argument names.
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

from .. import locks, nvfp4

__all__ = [
    "SEAMS",
    "builder_problem",
    "MoeCheckpoint",
    "MoeContext",
    "make_moe_checkpoint",
    "sglang_moe_context",
    "active_moe_context",
    "build_modelopt_moe_layer",
    "build_compressed_tensors_moe_layer",
    "moe_forward",
    "moe_weights",
    "reference_moe_output",
    "reference_moe_from_weights",
    "compressed_tensors_tensors",
    "build_moe_layer_from_tensors",
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
    except Exception as exc:  # noqa: BLE001 - the reason is the finding
        return f"SGLang {sglang_version()}: {RUNTIME_CONTEXT} does not import ({type(exc).__name__}: {exc})"
    missing = [name for name in SEAMS if not hasattr(module, name)]
    if missing:
        return (f"building SGLang's FusedMoE on a CPU needs its scoped runtime seams ({', '.join(SEAMS)}); "
                f"SGLang {sglang_version()}'s runtime_context lacks {', '.join(missing)}")
    return None


MODELOPT = "modelopt_fp4"
COMPRESSED_TENSORS = "compressed-tensors"
_QUANTIZATIONS = (MODELOPT, COMPRESSED_TENSORS)
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
            "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                        "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                                  "symmetric": True, "dynamic": "local"},
        }
    },
}
_MODELOPT_QUANT_CONFIG = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                          "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}


# --------------------------------------------------------------------------------------------
# The checkpoint
# --------------------------------------------------------------------------------------------


@dataclass
class MoeCheckpoint:
    """ModelOpt NVFP4 tensors of one MoE layer (E experts, hidden H, intermediate I), stacked over experts.

    ``S`` below is the number of w13 shards: 2 for "swiglu" (w1 = gate, w3 = up), 1 for "relu2" (the
    non-gated expert has only an up projection, which SGLang loads as shard w1). Rows of ``w13_*`` are
    in checkpoint (logical) order, ``[gate; up]``: each shard is one ModelOpt tensor on disk (see
    :meth:`tensors`). SGLang's loader, not this class, puts them in the kernel's ``[up; gate]`` order.
    """

    activation: str  # "swiglu" or "relu2"
    w13_weight: torch.Tensor  # uint8 (E, S*I, H/2), packed E2M1, rows [gate; up]
    w13_weight_scale: torch.Tensor  # float8_e4m3fn (E, S*I, H/16), not swizzled (as on disk)
    w13_weight_scale_2: torch.Tensor  # float32 (E, S): 1 / weight global scale per shard (gate == up)
    w13_input_scale: torch.Tensor  # float32 (E, S): 1 / calibrated activation global scale per shard
    w2_weight: torch.Tensor  # uint8 (E, H, I/2)
    w2_weight_scale: torch.Tensor  # float8_e4m3fn (E, H, I/16), not swizzled
    w2_weight_scale_2: torch.Tensor  # float32 (E,)
    w2_input_scale: torch.Tensor  # float32 (E,)
    dense_gate: torch.Tensor | None  # bf16 (E, I, H) the gate weights it was made from (None for relu2)
    dense_up: torch.Tensor  # bf16 (E, I, H)
    dense_down: torch.Tensor  # bf16 (E, H, I)

    @property
    def num_experts(self) -> int:
        return self.w13_weight.shape[0]

    @property
    def hidden(self) -> int:
        return self.w2_weight.shape[1]

    @property
    def intermediate(self) -> int:
        return self.w2_weight.shape[2] * 2

    @property
    def gated(self) -> bool:
        return self.activation == "swiglu"

    def shard_names(self) -> tuple[str, ...]:
        """The checkpoint's names of the w13 shards, in row order (nemotron_h's relu2 experts: up_proj)."""
        return ("gate_proj", "up_proj") if self.gated else ("up_proj",)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The per-expert tensors as a ModelOpt safetensors file names them (``experts.{e}.{proj}.{kind}``)."""
        out: dict[str, torch.Tensor] = {}
        inter = self.intermediate
        for e in range(self.num_experts):
            for s, proj in enumerate(self.shard_names()):
                rows = slice(s * inter, (s + 1) * inter)
                p = f"experts.{e}.{proj}."
                out[p + "weight"] = self.w13_weight[e, rows]
                out[p + "weight_scale"] = self.w13_weight_scale[e, rows]
                out[p + "weight_scale_2"] = self.w13_weight_scale_2[e, s].reshape(())
                out[p + "input_scale"] = self.w13_input_scale[e, s].reshape(())
            p = f"experts.{e}.down_proj."
            out[p + "weight"] = self.w2_weight[e]
            out[p + "weight_scale"] = self.w2_weight_scale[e]
            out[p + "weight_scale_2"] = self.w2_weight_scale_2[e].reshape(())
            out[p + "input_scale"] = self.w2_input_scale[e].reshape(())
        return out


def _check_activation(activation: object) -> str:
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
    return activation  # type: ignore[return-value]


def make_moe_checkpoint(
    num_experts: int, hidden: int, intermediate: int, activation: str = "swiglu", seed: int = 0
) -> MoeCheckpoint:
    """Quantize random per-expert bf16 weights with nvfp4 into ModelOpt's NVFP4 MoE checkpoint layout.

    Experts differ in magnitude, so per-expert scales matter. Gate and up of an expert share one
    weight global scale (``w13_weight_scale_2[:, 0] == [:, 1]``), as ModelOpt exports a fused gate/up:
    SGLang's cutlass path passes only the gate's alpha (``g1_alphas``) to the kernel, for both halves,
    so a checkpoint with unequal values would not be served faithfully. The input scales are calibrated on
    random activations and differ per expert, so SGLang's max over experts matters too.

    ``hidden`` and ``intermediate`` must be multiples of 16; SGLang's flashinfer_cutlass path also
    needs the per-rank intermediate size to be a multiple of 64 for "swiglu" (it cannot pad a gated
    w13) and pads it to a multiple of 128 for "relu2".
    """
    activation = _check_activation(activation)
    for name, value in (("num_experts", num_experts), ("hidden", hidden), ("intermediate", intermediate)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if hidden % nvfp4.BLOCK_SIZE or intermediate % nvfp4.BLOCK_SIZE:
        raise ValueError(f"hidden and intermediate must be multiples of {nvfp4.BLOCK_SIZE}, "
                         f"got {hidden}, {intermediate}")
    gated = activation == "swiglu"
    gen = torch.Generator().manual_seed(seed)
    bf16 = torch.bfloat16
    calibration = (torch.randn(64, hidden, generator=gen) * 1.5).to(bf16)
    x_amax_scale = nvfp4.global_scale(calibration)
    stacks: dict[str, list[torch.Tensor]] = {k: [] for k in (
        "w13", "w13_sf", "w13_s2", "w13_in", "w2", "w2_sf", "w2_s2", "w2_in", "gate", "up", "down")}
    for e in range(num_experts):
        spread = 1.0 + 0.5 * e / max(num_experts - 1, 1)  # experts of different magnitude
        gate = (torch.randn(intermediate, hidden, generator=gen) * 0.04 * spread).to(bf16)
        up = (torch.randn(intermediate, hidden, generator=gen) * 0.03 * spread).to(bf16)
        down = (torch.randn(hidden, intermediate, generator=gen) * 0.05 / spread).to(bf16)
        w13_dense = torch.cat([gate, up]) if gated else up
        gsf13 = nvfp4.global_scale(w13_dense)  # one global scale for the fused gate/up
        packed13, sf13 = nvfp4.quantize(w13_dense, gsf13)
        gsf2 = nvfp4.global_scale(down)
        packed2, sf2 = nvfp4.quantize(down, gsf2)
        # Calibrated activation scales: what each expert saw (slightly different per expert).
        xf = calibration.float()
        h = xf @ up.float().T
        h = torch.nn.functional.silu(xf @ gate.float().T) * h if gated else torch.relu(h) ** 2
        x_gsf = x_amax_scale / (1.0 + 0.1 * e)
        h_gsf = nvfp4.global_scale(h) / (1.0 + 0.05 * e)
        shards = 2 if gated else 1
        stacks["w13"].append(packed13)
        stacks["w13_sf"].append(nvfp4.unswizzle_scales(sf13, w13_dense.shape[0], hidden))
        stacks["w13_s2"].append((1.0 / gsf13).reshape(1).expand(shards))
        stacks["w13_in"].append((1.0 / x_gsf).reshape(1).expand(shards))
        stacks["w2"].append(packed2)
        stacks["w2_sf"].append(nvfp4.unswizzle_scales(sf2, hidden, intermediate))
        stacks["w2_s2"].append((1.0 / gsf2).reshape(()))
        stacks["w2_in"].append((1.0 / h_gsf).reshape(()))
        stacks["gate"].append(gate)
        stacks["up"].append(up)
        stacks["down"].append(down)
    st = {k: torch.stack(v).contiguous() for k, v in stacks.items()}
    return MoeCheckpoint(
        activation=activation,
        w13_weight=st["w13"],
        w13_weight_scale=st["w13_sf"],
        w13_weight_scale_2=st["w13_s2"].float(),
        w13_input_scale=st["w13_in"].float(),
        w2_weight=st["w2"],
        w2_weight_scale=st["w2_sf"],
        w2_weight_scale_2=st["w2_s2"].float(),
        w2_input_scale=st["w2_in"].float(),
        dense_gate=st["gate"] if gated else None,
        dense_up=st["up"],
        dense_down=st["down"],
    )


def compressed_tensors_tensors(ckpt: MoeCheckpoint) -> dict[str, torch.Tensor]:
    """The same quantized experts under compressed-tensors (llm-compressor NVFP4) names.

    ``weight_packed`` and ``weight_scale`` are ModelOpt's bytes; ``weight_global_scale`` and
    ``input_global_scale`` are the encode scales themselves, ``1 / weight_scale_2`` and
    ``1 / input_scale`` (float32, shape (1,)), as llm-compressor stores them.
    """
    out = {}
    for name, value in ckpt.tensors().items():
        stem, kind = name.rsplit(".", 1)
        if kind == "weight":
            out[stem + ".weight_packed"] = value
        elif kind == "weight_scale":
            out[stem + ".weight_scale"] = value
        elif kind == "weight_scale_2":
            out[stem + ".weight_global_scale"] = (1.0 / value.float()).reshape(1)
        elif kind == "input_scale":
            out[stem + ".input_global_scale"] = (1.0 / value.float()).reshape(1)
    return out


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
        return _Settings(self.moe_runner_backend, self.quantization, self.ep_size, self.ep_rank,
                         self.tp_size, self.tp_rank)


_ACTIVE: list[MoeContext] = []  # innermost last; SGLang's use_context is process-global too
_LOCK = locks.rlock()  # serializes the scopes: SGLang's seams are process globals
_LAYER_SETTINGS: "weakref.WeakKeyDictionary[torch.nn.Module, _Settings]" = weakref.WeakKeyDictionary()


def active_moe_context() -> MoeContext | None:
    """The innermost active :func:`sglang_moe_context`, or None."""
    return _ACTIVE[-1] if _ACTIVE else None


def _check_ranks(ep_size: int, ep_rank: int, tp_size: int, tp_rank: int) -> None:
    for size, rank, what in ((ep_size, ep_rank, "ep"), (tp_size, tp_rank, "tp")):
        if not isinstance(size, int) or not isinstance(rank, int) or size < 1 or not 0 <= rank < size:
            raise ValueError(f"{what}_size must be an int >= 1 and {what}_rank in [0, {what}_size), "
                             f"got {what}_size={size!r}, {what}_rank={rank!r}")


def _write_model_dir(root: str, quantization: str) -> str:
    """A local model directory SGLang's ModelConfig reads without the hub (config.json only).

    Its sizes are placeholders: they only feed server-args resolution, never the layer, whose sizes
    come from the checkpoint. The quantization config is what a real export carries.
    """
    quant = _MODELOPT_QUANT_CONFIG if quantization == MODELOPT else _CT_QUANT_CONFIG
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": 256, "moe_intermediate_size": 128, "intermediate_size": 1024,
        "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "vocab_size": 1024, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
        "hidden_act": "silu", "decoder_sparse_step": 1, "mlp_only_layers": [], "torch_dtype": "bfloat16",
        "tie_word_embeddings": False, "quantization_config": quant,
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
    _check_ranks(ep_size, ep_rank, tp_size, tp_rank)
    if quantization not in _QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {_QUANTIZATIONS}, got {quantization!r}")
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
        server_args = ServerArgs(model_path=model_dir, moe_runner_backend=moe_runner_backend, device="cpu",
                                 skip_tokenizer_init=True,
                                 quantization=quantization if quantization == MODELOPT else None, **(server_args or {}))
        context = rc.create_context(server_args, role="scheduler")
        stack.enter_context(rc.use_context(context))
        stack.enter_context(rc.get_parallel().override(
            tp_size=world, tp_rank=rank, attn_tp_size=world, attn_tp_rank=rank,
            moe_ep_size=ep_size, moe_ep_rank=ep_rank, moe_tp_size=tp_size, moe_tp_rank=tp_rank, tp_group=None,
        ))
        moe_utils.initialize_moe_config()
        handle = MoeContext(moe_runner_backend, quantization, ep_size, ep_rank, tp_size, tp_rank,
                            model_dir, server_args, context)
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
                settings.quantization, settings.ep_size, settings.ep_rank, settings.tp_size, settings.tp_rank)
            if same:
                yield active
                return
            if strict:
                raise ValueError(
                    f"the active sglang_moe_context is {mine}; this call asks for quantization="
                    f"{settings.quantization!r}, ep_size={settings.ep_size}, ep_rank={settings.ep_rank}, "
                    f"tp_size={settings.tp_size}, tp_rank={settings.tp_rank}: pass the context's values, "
                    "or call it outside the context")
        with sglang_moe_context(settings.moe_runner_backend, ep_size=settings.ep_size, ep_rank=settings.ep_rank,
                                tp_size=settings.tp_size, tp_rank=settings.tp_rank,
                                quantization=settings.quantization) as fresh:
            yield fresh


# --------------------------------------------------------------------------------------------
# Building the real layer
# --------------------------------------------------------------------------------------------


def _load_into(layer, ckpt: MoeCheckpoint, tensors: Mapping[str, torch.Tensor]) -> int:
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
                raise KeyError(f"{name} maps to {param_name!r}, which this layer does not have")
            param.weight_loader(param, tensor, f"{_PREFIX.rsplit('.', 1)[0]}.{name}", shard_id=shard_id,
                                expert_id=expert_id)
            loaded += 1
            break
        else:
            raise KeyError(f"checkpoint tensor {name} matches no expert parameter of this layer")
    return loaded


def _build(ckpt: MoeCheckpoint, top_k: int, dtype: torch.dtype, settings: _Settings, make_quant_config):
    if not isinstance(top_k, int) or not 1 <= top_k <= ckpt.num_experts:
        raise ValueError(f"top_k must be an int in [1, {ckpt.num_experts}], got {top_k!r}")
    _check_ranks(settings.ep_size, settings.ep_rank, settings.tp_size, settings.tp_rank)
    if ckpt.num_experts % settings.ep_size or ckpt.intermediate % settings.tp_size:
        raise ValueError(f"{ckpt.num_experts} experts / intermediate {ckpt.intermediate} do not split over "
                         f"ep_size={settings.ep_size} / tp_size={settings.tp_size}")
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    sglang_activation, is_gated = _ACTIVATIONS[ckpt.activation]
    with _context_for(settings, strict=True) as ctx:
        quant_config, tensors = make_quant_config(ckpt)
        with torch.no_grad():
            layer = FusedMoE(
                num_experts=ckpt.num_experts, hidden_size=ckpt.hidden, intermediate_size=ckpt.intermediate,
                layer_id=0, top_k=top_k, params_dtype=dtype, quant_config=quant_config, prefix=_PREFIX,
                activation=sglang_activation, is_gated=is_gated,
            )
            _load_into(layer, ckpt, tensors)
            layer.quant_method.process_weights_after_loading(layer)
        _LAYER_SETTINGS[layer] = ctx.settings()
    return layer


def build_modelopt_moe_layer(
    ckpt: MoeCheckpoint,
    top_k: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    ep_size: int = 1,
    ep_rank: int = 0,
    tp_size: int = 1,
    tp_rank: int = 0,
):
    """SGLang's FusedMoE + ModelOptFp4Config (ModelOptNvFp4FusedMoEMethod) for rank (ep_rank, tp_rank).

    The checkpoint's per-expert tensors (:meth:`MoeCheckpoint.tensors`) go through SGLang's own
    ``weight_loader`` (it keeps this rank's experts and I-slice, and writes w13 as ``[up; gate]``),
    then ``quant_method.process_weights_after_loading(layer)`` runs. `dtype` is the model's
    activation dtype (SGLang's params_dtype). Inside an active :func:`sglang_moe_context` with the
    same ranks the layer is built there (with that context's runner backend); an active context with
    other ranks or quantization is a ValueError; with none active, a
    ``sglang_moe_context("flashinfer_cutlass", ...)`` is held for the build.
    """
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptFp4Config

    def quant(ck):
        return ModelOptFp4Config(is_checkpoint_nvfp4_serialized=True, group_size=16), ck.tensors()

    settings = _Settings(_default_backend(), MODELOPT, ep_size, ep_rank, tp_size, tp_rank)
    return _build(ckpt, top_k, dtype, settings, quant)


def build_compressed_tensors_moe_layer(
    ckpt: MoeCheckpoint,
    top_k: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    ep_size: int = 1,
    ep_rank: int = 0,
    tp_size: int = 1,
    tp_rank: int = 0,
):
    """SGLang's FusedMoE + CompressedTensorsConfig (CompressedTensorsW4A4Nvfp4MoE), the checkpoint
    converted by :func:`compressed_tensors_tensors`; otherwise as :func:`build_modelopt_moe_layer`
    (its context has ``quantization="compressed-tensors"``; with none active, the build holds
    ``sglang_moe_context("auto", quantization="compressed-tensors", ...)``).

    SGLang's compressed-tensors config picks the W4A4 scheme by asking
    ``torch.cuda.get_device_capability()`` directly, which no SGLang seam reaches (and which raises
    without CUDA). The config *instance* built here answers that one question from SGLang's own
    platform facts (``get_platform().device_capability``, SM120 in the context) instead; no global is
    touched. The scheme is gated only (SGLang's ``create_weights`` always makes ``2 * I`` rows), so a
    "relu2" checkpoint is a ValueError.
    """
    if not ckpt.gated:
        raise ValueError("CompressedTensorsW4A4Nvfp4MoE has gated (swiglu) experts only; got a relu2 checkpoint")
    from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    def quant(ck):
        config = CompressedTensorsConfig.from_config(json.loads(json.dumps(_CT_QUANT_CONFIG)))
        config._check_scheme_supported = _platform_scheme_check
        return config, compressed_tensors_tensors(ck)

    settings = _Settings(_default_backend("auto"), COMPRESSED_TENSORS, ep_size, ep_rank, tp_size, tp_rank)
    return _build(ckpt, top_k, dtype, settings, quant)


def build_moe_layer_from_tensors(spec, tensors: Mapping[str, torch.Tensor], top_k: int, *, fmt: str,
                                 dtype: torch.dtype = torch.bfloat16):
    """SGLang's FusedMoE for a checkpoint's own experts (``sm120-fp4 selftest --model``).

    `spec` has ``num_experts``, ``hidden``, ``intermediate``, ``gated`` and ``activation``; `tensors` are
    named ``experts.{e}.{gate_proj|up_proj|down_proj}.{kind}`` with the format's own kinds and values
    (ModelOpt: weight, weight_scale, weight_scale_2, input_scale; compressed-tensors: weight_packed,
    weight_scale, weight_global_scale, input_global_scale); `fmt` ("modelopt" or "compressed-tensors")
    picks SGLang's quantization method, as the checkpoint's config does. Built at rank 0 of 1 on the
    default device.
    """
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptFp4Config

    if fmt == "modelopt":
        def quant(ck):
            return ModelOptFp4Config(is_checkpoint_nvfp4_serialized=True, group_size=16), tensors

        return _build(spec, top_k, dtype, _Settings(_default_backend(), MODELOPT, 1, 0, 1, 0), quant)
    if not spec.gated:
        raise ValueError("CompressedTensorsW4A4Nvfp4MoE has gated (swiglu) experts only; the checkpoint's are not")
    from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    def ct_quant(ck):
        return CompressedTensorsConfig.from_config(json.loads(json.dumps(_CT_QUANT_CONFIG))), tensors

    return _build(spec, top_k, dtype, _Settings(_default_backend("auto"), COMPRESSED_TENSORS, 1, 0, 1, 0), ct_quant)


def _platform_scheme_check(min_capability: int, error: bool = True) -> bool:
    """CompressedTensorsConfig._check_scheme_supported, answered from SGLang's platform facts."""
    from sglang.srt.runtime_context import get_platform

    major, minor = get_platform().device_capability
    supported = major * 10 + minor >= min_capability
    if error and not supported:
        raise RuntimeError(f"Quantization scheme is not supported: min capability {min_capability}, "
                           f"platform {major * 10 + minor}")
    return supported


def _default_backend(default: str = "flashinfer_cutlass") -> str:
    active = active_moe_context()
    return active.moe_runner_backend if active is not None else default


# --------------------------------------------------------------------------------------------
# Forward, weights, reference
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
        raise ValueError("moe_forward needs a layer made by build_modelopt_moe_layer or "
                         "build_compressed_tensors_moe_layer")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both "
                         f"be (T={x.shape[0]}, k)")
    topk = StandardTopKOutput(topk_weights.to(torch.float32), topk_ids.to(torch.int32), None)
    with _context_for(settings, strict=False), torch.no_grad():
        return layer(x, topk)


def _method_kind(layer) -> str:
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptNvFp4FusedMoEMethod

    if isinstance(layer.quant_method, ModelOptNvFp4FusedMoEMethod):
        return MODELOPT
    scheme = getattr(layer, "scheme", None)
    if scheme is not None and type(scheme).__name__ == "CompressedTensorsW4A4Nvfp4MoE":
        return COMPRESSED_TENSORS
    raise TypeError(f"not an NVFP4 MoE layer this module knows: quant_method {type(layer.quant_method).__name__}, "
                    f"scheme {type(scheme).__name__}")


def moe_weights(layer) -> dict:
    """The processed tensors SGLang passes to the kernel, in ``nvfp4.reference_moe_fp4``'s names.

    Read from the layer as ``process_weights_after_loading`` left it (views, not copies):

    ========== =============================================== =========================================
    key        ModelOptNvFp4FusedMoEMethod                     CompressedTensorsW4A4Nvfp4MoE
    ========== =============================================== =========================================
    w13        ``w13_weight`` uint8 (E_loc, 2I, H/2) [up; gate] (relu2: (E_loc, I_pad, H/2))
    w13_sf     ``w13_blockscale_swizzled`` (never               ``w13_weight_scale`` (swizzled in place
               ``w13_weight_scale``: it is an alias only when   under the same name)
               the swizzled shape equals the plain one)
    w13_alpha  ``g1_alphas`` (E_loc,) (gate's; ``g1_alphas_up`` ``g1_alphas``
               is not passed to cutlass)
    w2, w2_sf  ``w2_weight``, ``w2_blockscale_swizzled``        ``w2_weight``, ``w2_weight_scale``
    w2_alpha   ``g2_alphas`` (E_loc,)                           ``g2_alphas``
    a1_gscale  ``w13_input_scale_quant`` 0-dim (1 / max over    ``w13_input_scale_quant`` **(E_loc,)**
               all experts' input scales)                       (one per local expert)
    a2_gscale  ``w2_input_scale_quant`` 0-dim                   ``w2_input_scale_quant`` **(E_loc,)**
    ========== =============================================== =========================================

    ``w13_sf``/``w2_sf`` are float8_e4m3fn, (E_loc, ceil128(rows), ceil4(K/16)). Per-expert
    ``a1_gscale``/``a2_gscale`` (compressed-tensors) are beyond one ``reference_moe_fp4`` call, which
    takes one scale: :func:`reference_moe_from_weights` handles both. Also: ``activation`` ("swiglu" /
    "relu2"), ``quantization``, ``num_local_experts``, ``num_experts`` (global), ``first_expert``
    (``ep_rank * num_local_experts``: kernel-side ids are global), ``hidden``,
    ``intermediate_per_partition`` (SGLang's, before relu2 padding; ``w13.shape[1]`` is the padded
    size the kernel sees), ``top_k``, ``ep_rank``, ``ep_size``, ``tp_rank``, ``tp_size``, ``dtype``.
    A configured SwiGLU clamp (``_cutlass_swiglu_params``) is not modelled: NotImplementedError.
    """
    kind = _method_kind(layer)
    config = layer.moe_runner_config
    if config.is_gated and config.activation == "silu":
        activation = "swiglu"
    elif not config.is_gated and config.activation == "relu2":
        activation = "relu2"
    else:
        raise NotImplementedError(f"activation {config.activation!r} (is_gated={config.is_gated}) is not modelled")
    swiglu = getattr(layer, "_cutlass_swiglu_params", (None, None, None))
    if any(p is not None for p in swiglu):
        raise NotImplementedError("a SwiGLU clamp (swiglu_alpha/beta/limit) reaches the kernel; not modelled")
    if kind == MODELOPT:
        w13_sf, w2_sf = layer.w13_blockscale_swizzled, layer.w2_blockscale_swizzled
    else:
        w13_sf, w2_sf = layer.w13_weight_scale, layer.w2_weight_scale
    w13 = layer.w13_weight.detach().view(torch.uint8)
    w2 = layer.w2_weight.detach().view(torch.uint8)
    e_loc, rows13, h_half = w13.shape
    for name, sf, rows, k in (("w13_sf", w13_sf, rows13, h_half * 2), ("w2_sf", w2_sf, w2.shape[1], w2.shape[2] * 2)):
        want = (e_loc, *nvfp4.swizzled_scale_shape(rows, k))
        if tuple(sf.shape) != want:
            raise RuntimeError(f"{name}: SGLang's processed scales have shape {tuple(sf.shape)}, expected the "
                               f"swizzled {want}")
    return {
        "w13": w13,
        "w13_sf": w13_sf.detach().view(torch.float8_e4m3fn),
        "w13_alpha": layer.g1_alphas.detach(),
        "w2": w2,
        "w2_sf": w2_sf.detach().view(torch.float8_e4m3fn),
        "w2_alpha": layer.g2_alphas.detach(),
        "a1_gscale": layer.w13_input_scale_quant.detach(),
        "a2_gscale": layer.w2_input_scale_quant.detach(),
        "activation": activation,
        "quantization": kind,
        "num_local_experts": int(layer.num_local_experts),
        "num_experts": int(layer.num_experts),
        "first_expert": int(layer.moe_ep_rank) * int(layer.num_local_experts),
        "hidden": int(layer.hidden_size),
        "intermediate_per_partition": int(layer.intermediate_size_per_partition),
        "top_k": layer.top_k,
        "ep_rank": int(layer.moe_ep_rank),
        "ep_size": int(layer.moe_ep_size),
        "tp_rank": int(layer.moe_tp_rank),
        "tp_size": int(layer.moe_tp_size),
        "dtype": layer.params_dtype,
    }


def reference_moe_from_weights(
    weights: Mapping[str, Any], x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """One rank's MoE output from a :func:`moe_weights`-style dict, through ``nvfp4.reference_moe_fp4``.

    `topk_ids` are global expert ids, as the kernel receives them; experts
    ``[first_expert, first_expert + E_loc)`` are this rank's, other slots contribute nothing (the
    kernel skips them). With one activation scale each (ModelOpt) this is a single
    ``reference_moe_fp4`` call, the non-local slots entering on local expert 0 with weight 0 (0 * a
    finite row adds nothing to the float32 sum). With per-expert scales (compressed-tensors: the
    kernel quantizes each expert's rows with that expert's scale) each local expert is one
    ``reference_moe_fp4`` call on its rows (top-1, weight 1, float32 output: the expert's rows rounded
    to x's dtype), and the rows are then combined exactly as ``reference_moe_fp4`` finalizes: in
    float32, slot by slot, ``out + w[:, slot] * row``, cast to x's dtype.
    """
    e_loc = weights["w13"].shape[0]
    first = int(weights.get("first_expert", 0))
    ids = topk_ids.long() - first
    local = (ids >= 0) & (ids < e_loc)
    tensors = {k: weights[k] for k in ("w13", "w13_sf", "w13_alpha", "w2", "w2_sf", "w2_alpha")}
    a1, a2 = weights["a1_gscale"], weights["a2_gscale"]
    activation = weights["activation"]
    per_expert = any(isinstance(a, torch.Tensor) and a.numel() > 1 for a in (a1, a2))
    if not per_expert:
        return nvfp4.reference_moe_fp4(
            x, torch.where(local, ids, 0), torch.where(local, topk_weights.float(), 0.0),
            a1_gscale=a1.reshape(()) if isinstance(a1, torch.Tensor) else a1,
            a2_gscale=a2.reshape(()) if isinstance(a2, torch.Tensor) else a2,
            activation=activation, **tensors)
    tokens, top_k = topk_ids.shape
    routed = torch.zeros((tokens, top_k, x.shape[1]), dtype=torch.float32, device=x.device)
    for expert in range(e_loc):
        tok, slot = (ids == expert).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        one = {k: v[expert : expert + 1] for k, v in tensors.items()}
        scale = lambda a: a.reshape(-1)[expert] if isinstance(a, torch.Tensor) and a.numel() > 1 else a  # noqa: E731
        routed[tok, slot] = nvfp4.reference_moe_fp4(
            x[tok], torch.zeros((tok.numel(), 1), dtype=torch.int64, device=x.device),
            torch.ones((tok.numel(), 1), dtype=torch.float32, device=x.device),
            a1_gscale=scale(a1).reshape(()), a2_gscale=scale(a2).reshape(()), activation=activation,
            out_dtype=torch.float32, **one)
    out = torch.zeros((tokens, x.shape[1]), dtype=torch.float32, device=x.device)
    for slot in range(top_k):
        weight = torch.where(local[:, slot : slot + 1], topk_weights[:, slot : slot + 1].float(), 0.0)
        out = out + weight * routed[:, slot]
    return out.to(x.dtype)


def _rank_tensors(ckpt: MoeCheckpoint, ep_size: int, ep_rank: int, tp_size: int, tp_rank: int):
    """This rank's experts and I-slice of the checkpoint, w13 rows in the kernel's [up; gate] order,
    scales swizzled per expert: the layout the kernel receives, made without SGLang."""
    e_loc, i_p = ckpt.num_experts // ep_size, ckpt.intermediate // tp_size
    experts = slice(ep_rank * e_loc, (ep_rank + 1) * e_loc)
    cols = slice(tp_rank * i_p, (tp_rank + 1) * i_p)
    inter = ckpt.intermediate
    shards = [1, 0] if ckpt.gated else [0]  # kernel order: up rows first, then gate
    w13 = torch.cat([ckpt.w13_weight[experts, s * inter :][:, cols] for s in shards], dim=1)
    w13_plain_sf = torch.cat([ckpt.w13_weight_scale[experts, s * inter :][:, cols] for s in shards], dim=1)
    w2 = ckpt.w2_weight[experts][:, :, cols.start // 2 : cols.stop // 2]
    w2_plain_sf = ckpt.w2_weight_scale[experts][:, :, cols.start // 16 : cols.stop // 16]
    w13_sf = torch.stack([nvfp4.swizzle_scales(s.contiguous()) for s in w13_plain_sf])
    w2_sf = torch.stack([nvfp4.swizzle_scales(s.contiguous()) for s in w2_plain_sf])
    return experts, w13.contiguous(), w13_sf, w2.contiguous(), w2_sf


def reference_moe_output(
    ckpt: MoeCheckpoint,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    ep_size: int = 1,
    ep_rank: int = 0,
    tp_size: int = 1,
    tp_rank: int = 0,
    quantization: str = MODELOPT,
) -> torch.Tensor:
    """What rank (ep_rank, tp_rank)'s layer must compute, from the checkpoint alone (never the layer).

    A rank's output is a **partial** sum: over the slots routed to its experts
    ``[ep_rank * E/ep_size, (ep_rank+1) * E/ep_size)`` only (`topk_ids` are global ids), and, under
    TP, the FC2 of its slice ``[tp_rank * I/tp_size, (tp_rank+1) * I/tp_size)`` of the intermediate
    (FC1 rows of that slice for gate and for up, FC2 columns of it; 16-blocks never straddle
    slices). SGLang all-reduces the partials; their sum equals the single-rank output up to the
    rounding of each partial to x's dtype.

    The kernel's constants are derived as SGLang's cutlass path states them, in float32:
    ModelOpt: ``in = max(w13_input_scale over all E experts and shards)``, ``a1_gscale = 1 / in``,
    ``w13_alpha[e] = in * w13_weight_scale_2[e, 0]``, likewise ``a2``/``w2_alpha`` from
    ``w2_input_scale`` and ``w2_weight_scale_2``. compressed-tensors (from
    :func:`compressed_tensors_tensors`): per local expert ``a1[e] = min(input_global_scale[e, :])``,
    ``w13_alpha[e] = (1 / a1[e]) * (1 / weight_global_scale[e, 0])``, ``a2[e] = w2 input_global_scale[e]``,
    ``w2_alpha[e] = (1 / a2[e]) * (1 / w2 weight_global_scale[e])``. The weights are the
    checkpoint's bytes, sliced and put in the kernel's layout here; everything numeric is
    ``nvfp4.reference_moe_fp4`` (see :func:`reference_moe_from_weights`).

    One alpha per expert cannot express gate and up weight scales that differ: such a checkpoint
    is a ValueError (SGLang's cutlass path would apply the gate's alpha to the up rows).
    """
    _check_ranks(ep_size, ep_rank, tp_size, tp_rank)
    if quantization not in _QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {_QUANTIZATIONS}, got {quantization!r}")
    if ckpt.num_experts % ep_size or ckpt.intermediate % (tp_size * nvfp4.BLOCK_SIZE):
        raise ValueError(f"{ckpt.num_experts} experts / intermediate {ckpt.intermediate} do not split over "
                         f"ep_size={ep_size} / tp_size={tp_size} in 16-blocks")
    if ckpt.gated and not torch.equal(ckpt.w13_weight_scale_2[:, 0], ckpt.w13_weight_scale_2[:, 1]):
        raise ValueError("gate and up weight_scale_2 differ: the cutlass path applies the gate's alpha to both "
                         "halves, and no single-alpha reference states what the checkpoint means")
    experts, w13, w13_sf, w2, w2_sf = _rank_tensors(ckpt, ep_size, ep_rank, tp_size, tp_rank)
    if quantization == MODELOPT:
        in13 = ckpt.w13_input_scale.max().to(torch.float32)
        in2 = ckpt.w2_input_scale.max().to(torch.float32)
        a1, a2 = (1 / in13).to(torch.float32), (1 / in2).to(torch.float32)
        alpha1 = (in13 * ckpt.w13_weight_scale_2[experts, 0]).to(torch.float32)
        alpha2 = (in2 * ckpt.w2_weight_scale_2[experts]).to(torch.float32)
    else:
        if not ckpt.gated:
            raise ValueError("compressed-tensors NVFP4 MoE has gated (swiglu) experts only")
        ct = compressed_tensors_tensors(ckpt)
        ids = range(experts.start, experts.stop)
        in_gs = torch.stack([torch.cat([ct[f"experts.{e}.{p}.input_global_scale"] for p in ckpt.shard_names()])
                             for e in ids])
        w_gs = torch.stack([ct[f"experts.{e}.gate_proj.weight_global_scale"][0] for e in ids])
        a1 = in_gs.min(dim=1).values.to(torch.float32)
        alpha1 = (1 / a1) * (1 / w_gs)
        a2 = torch.stack([ct[f"experts.{e}.down_proj.input_global_scale"][0] for e in ids])
        alpha2 = ((1 / a2) * (1 / torch.stack([ct[f"experts.{e}.down_proj.weight_global_scale"][0] for e in ids])))
        alpha2 = alpha2.to(torch.float32)
    weights = {
        "w13": w13, "w13_sf": w13_sf, "w13_alpha": alpha1.contiguous(), "w2": w2, "w2_sf": w2_sf,
        "w2_alpha": alpha2.contiguous(), "a1_gscale": a1, "a2_gscale": a2, "activation": ckpt.activation,
        "first_expert": experts.start,
    }
    device = x.device
    weights = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in weights.items()}
    return reference_moe_from_weights(weights, x, topk_ids, topk_weights)

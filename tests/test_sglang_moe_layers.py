"""SGLang 0.5.23's real NVFP4 FusedMoE on a CPU (sm120_fp4.sglang.moe_layers).

The kernel seam ``flashinfer_cutlass._flashinfer_cutlass_fused_moe`` is replaced, per test, by a
stand-in written here from ``nvfp4.reference_moe_fp4`` (the library's verified routing lives
elsewhere). The stand-in computes each expert's rows with ``reference_moe_fp4`` and sums the local
slots itself, a different route from the library's reference (one call, non-local slots at weight
0), so agreement is not by construction.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import warnings

import pytest
import torch
from helpers.common import simulated_moe_skip_reason

from sm120_fp4.sglang import release as _release

if simulated_moe_skip_reason() is not None:
    pytest.skip(simulated_moe_skip_reason(), allow_module_level=True)
_WHY = "needs the pinned SGLang (scripts/setup_env.sh)"
pytest.importorskip("sglang.srt.layers.moe.fused_moe_triton.layer", reason=_WHY)
pytest.importorskip("sglang.srt.layers.moe.moe_runner.flashinfer_cutlass", reason=_WHY)
pytest.importorskip("sglang.srt.layers.quantization.modelopt_quant", reason=_WHY)
pytest.importorskip("sglang.srt.runtime_context", reason=_WHY)

from helpers import sglang_layers  # noqa: E402
from sglang.srt import runtime_context as rc  # noqa: E402
from sglang.srt.layers.moe.moe_runner import flashinfer_cutlass as fc  # noqa: E402

from sm120_fp4 import nvfp4  # noqa: E402
from sm120_fp4.demo import synthetic  # noqa: E402
from sm120_fp4.sglang import moe_layers as ml  # noqa: E402

pytestmark = pytest.mark.sglang

E, H, I, K, T = 8, 128, 128, 2, 24
BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        level = logging.getLogger("sglang").level
        logging.getLogger("sglang").setLevel(logging.ERROR)
        yield
        logging.getLogger("sglang").setLevel(level)


# --------------------------------------------------------------------------------------------
# The test-local kernel stand-in
# --------------------------------------------------------------------------------------------

try:
    from flashinfer.fused_moe.core import ActivationType
except Exception:  # FlashInfer not installed: the names SGLang reads, with FlashInfer's values
    ActivationType = enum.IntEnum(
        "ActivationType",
        {"Gelu": 0, "Relu": 1, "Silu": 2, "Swiglu": 3, "Geglu": 4, "SwigluBias": 5, "Relu2": 6, "Identity": 7},
    )


def _r(v: int, m: int) -> int:
    return -(-v // m) * m


def cutlass_fused_moe_stand_in(calls: list):
    """NVFP4 ``cutlass_fused_moe`` from nvfp4.reference_moe_fp4, keyword call as SGLang makes it."""

    def run(
        *,
        output,
        input,
        token_selected_experts,
        token_final_scales,
        fc1_expert_weights,
        fc2_expert_weights,
        output_dtype,
        quant_scales,
        input_sf=None,
        swiglu_alpha=None,
        swiglu_beta=None,
        swiglu_limit=None,
        ep_size=1,
        ep_rank=0,
        tp_size=1,
        tp_rank=0,
        activation_type=ActivationType.Swiglu,
        **rest,
    ):
        assert input_sf is None and swiglu_limit is None and swiglu_alpha is None and swiglu_beta is None
        assert fc1_expert_weights.dtype == torch.int64 and len(quant_scales) == 6, "not an NVFP4 call"
        calls.append(
            dict(
                ids=token_selected_experts.clone(),
                quant_scales=list(quant_scales),
                ep_size=ep_size,
                ep_rank=ep_rank,
                tp_size=tp_size,
                tp_rank=tp_rank,
                activation_type=activation_type,
            )
        )
        a1, sf1, g1, a2, sf2, g2 = quant_scales
        w13, w2 = fc1_expert_weights.view(torch.uint8), fc2_expert_weights.view(torch.uint8)
        e_loc, rows13, hidden = w13.shape[0], w13.shape[1], w13.shape[2] * 2
        inter = w2.shape[2] * 2
        activation = {ActivationType.Swiglu: "swiglu", ActivationType.Relu2: "relu2"}[ActivationType(activation_type)]
        # FlashInfer 0.7.2's NVFP4 argument checks (flashinfer_cutlass_fused_moe_binding.cu).
        assert sf1.dtype == sf2.dtype == torch.int32
        assert tuple(sf1.shape) == (e_loc, _r(inter, 64) * (2 if activation == "swiglu" else 1), _r(hidden, 64) // 64)
        assert tuple(sf2.shape) == (e_loc, _r(hidden, 128), _r(inter, 64) // 64)
        assert g1.shape == g2.shape == (e_loc,) and a1.dim() <= 1 and a2.dim() <= 1
        sf1 = sf1.view(torch.float8_e4m3fn).view(e_loc, *nvfp4.swizzled_scale_shape(rows13, hidden))
        sf2 = sf2.view(torch.float8_e4m3fn).view(e_loc, *nvfp4.swizzled_scale_shape(w2.shape[1], inter))
        local = token_selected_experts.long() - ep_rank * e_loc  # global ids -> this rank's
        rows = torch.zeros(*local.shape, hidden)
        for e in range(e_loc):
            tok, slot = (local == e).nonzero(as_tuple=True)
            if tok.numel():
                scale = lambda a: a.reshape(-1)[e if a.numel() > 1 else 0].reshape(())  # noqa: E731
                rows[tok, slot] = nvfp4.reference_moe_fp4(
                    input[tok],
                    torch.zeros(tok.numel(), 1, dtype=torch.int64),
                    torch.ones(tok.numel(), 1),
                    w13[e : e + 1],
                    sf1[e : e + 1],
                    g1[e : e + 1],
                    w2[e : e + 1],
                    sf2[e : e + 1],
                    g2[e : e + 1],
                    scale(a1),
                    scale(a2),
                    activation,
                    out_dtype=torch.float32,
                )
        acc = torch.zeros(input.shape[0], hidden)
        for slot in range(local.shape[1]):  # finalize: local slots only, in slot order, float32
            keep = ((local[:, slot] >= 0) & (local[:, slot] < e_loc)).unsqueeze(1)
            acc = torch.where(keep, acc + token_final_scales[:, slot : slot + 1] * rows[:, slot], acc)
        output.copy_(acc.to(output_dtype))
        return [output]

    return run


@pytest.fixture
def seam(monkeypatch):
    """The kernel seam, scoped to the test: SGLang's factory returns (stand-in, ActivationType)."""
    calls: list = []
    stand_in = cutlass_fused_moe_stand_in(calls)
    monkeypatch.setattr(fc, "_flashinfer_cutlass_fused_moe", lambda: (stand_in, ActivationType))
    return calls


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def routing(tokens: int, experts: int, top_k: int, seed: int = 3):
    """Distinct experts per token, renormalized softmax weights (what SGLang's TopK produces)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g)
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    return ids.to(torch.int32), (weights / weights.sum(-1, keepdim=True)).float()


def activations(tokens: int, hidden: int, seed: int = 1) -> torch.Tensor:
    return (torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed)) * 1.5).to(BF16)


def dense_moe(ckpt: synthetic.MoeCheckpoint, x, ids, weights) -> torch.Tensor:
    """Float32 MoE of the unquantized weights: a sanity bound on quantization noise."""
    out = torch.zeros(x.shape[0], ckpt.hidden)
    for e in range(ckpt.num_experts):
        tok, slot = (ids.long() == e).nonzero(as_tuple=True)
        xf = x[tok].float()
        up = xf @ ckpt.dense_up[e].float().T
        act = torch.nn.functional.silu(xf @ ckpt.dense_gate[e].float().T) * up if ckpt.gated else torch.relu(up) ** 2
        out.index_add_(0, tok, (act @ ckpt.dense_down[e].float().T) * weights[tok, slot].unsqueeze(1))
    return out


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def direct_reference(w: dict, x, ids, weights) -> torch.Tensor:
    """moe_weights(layer) straight into nvfp4.reference_moe_fp4 (all experts local)."""
    keys = ("w13", "w13_sf", "w13_alpha", "w2", "w2_sf", "w2_alpha", "a1_gscale", "a2_gscale", "activation")
    return nvfp4.reference_moe_fp4(x, ids, weights, **{k: w[k] for k in keys})


@pytest.fixture(scope="module")
def ckpt():
    return synthetic.make_moe_checkpoint(E, H, I, seed=5)


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------


def test_modelopt_layer_forward_is_the_checkpoint_reference(ckpt, seam):
    x, (ids, weights) = activations(T, H), routing(T, E, K)
    layer = ml.build_modelopt_moe_layer(ckpt, K)  # no context active: the build holds its own
    out = ml.moe_forward(layer, x, ids, weights)
    assert out.dtype == BF16 and out.shape == (T, H)
    want = synthetic.reference_moe_output(ckpt, x, ids, weights)
    assert torch.equal(out, want)
    assert rel(out, dense_moe(ckpt, x, ids, weights)) < 0.3  # quantization noise, not garbage

    w = sglang_layers.moe_weights(layer)
    assert torch.equal(direct_reference(w, x, ids, weights), out)
    assert torch.equal(synthetic.reference_moe_from_weights(w, x, ids, weights), out)
    # The loader wrote [up; gate]; moe_weights are exactly what reached the kernel.
    assert torch.equal(w["w13"][:, :I], ckpt.w13_weight[:, I:]) and torch.equal(w["w13"][:, I:], ckpt.w13_weight[:, :I])
    (call,) = seam
    assert call["quant_scales"][1].data_ptr() == w["w13_sf"].data_ptr() == layer.w13_blockscale_swizzled.data_ptr()
    assert call["quant_scales"][2] is layer.g1_alphas and torch.equal(call["ids"], ids)
    assert w["a1_gscale"].dim() == 0 and (w["num_local_experts"], w["top_k"], w["dtype"]) == (E, K, BF16)
    # A wrong weight (one expert's alpha) is seen.
    with torch.no_grad():
        layer.g2_alphas[int(ids[0, 0])] *= 1.5
    assert not torch.equal(ml.moe_forward(layer, x, ids, weights), want)


def test_relu2_non_gated_layer_padded_by_sglang(seam):
    ck = synthetic.make_moe_checkpoint(4, H, 96, activation="relu2", seed=9)  # I=96: SGLang pads the kernel's I to 128
    x, (ids, weights) = activations(T, H), routing(T, 4, K, seed=4)
    layer = ml.build_modelopt_moe_layer(ck, K)
    out = ml.moe_forward(layer, x, ids, weights)
    w = sglang_layers.moe_weights(layer)
    assert w["activation"] == "relu2" and w["w13"].shape == (4, 128, H // 2) and w["intermediate_per_partition"] == 96
    assert seam[0]["activation_type"] == ActivationType.Relu2
    assert torch.equal(out, synthetic.reference_moe_output(ck, x, ids, weights))
    assert torch.equal(out, direct_reference(w, x, ids, weights))
    assert rel(out, dense_moe(ck, x, ids, weights)) < 0.3


@pytest.mark.parametrize("ep_size,tp_size", [(2, 1), (1, 2)], ids=["ep2", "tp2"])
def test_ranks_partials_sum_to_the_single_rank_output(ckpt, seam, ep_size, tp_size):
    x, (ids, weights) = activations(T, H, seed=2), routing(T, E, K, seed=6)
    whole = synthetic.reference_moe_output(ckpt, x, ids, weights)
    total = torch.zeros(T, H)
    for ep_rank in range(ep_size):
        for tp_rank in range(tp_size):
            ranks = dict(ep_size=ep_size, ep_rank=ep_rank, tp_size=tp_size, tp_rank=tp_rank)
            with ml.sglang_moe_context(**ranks):
                layer = ml.build_modelopt_moe_layer(ckpt, K, **ranks)
                out = ml.moe_forward(layer, x, ids, weights)
            w = sglang_layers.moe_weights(layer)
            assert (w["num_local_experts"], w["intermediate_per_partition"]) == (E // ep_size, I // tp_size)
            assert (w["ep_rank"], w["tp_rank"], w["first_expert"]) == (ep_rank, tp_rank, ep_rank * E // ep_size)
            call = seam[-1]
            assert torch.equal(call["ids"], ids)  # global ids reach the kernel
            assert (call["ep_size"], call["ep_rank"], call["tp_size"], call["tp_rank"]) == tuple(ranks.values())
            assert torch.equal(out, sglang_layers.reference_moe_output(ckpt, x, ids, weights, **ranks))
            assert torch.equal(out, synthetic.reference_moe_from_weights(w, x, ids, weights))
            total += out.float()
    # Partials are each rounded to bf16: the sum agrees with one rank to bf16 rounding, not bits.
    assert rel(total, whole) < 1e-2
    assert torch.allclose(total, whole.float(), rtol=2**-7, atol=2**-7 * float(whole.float().abs().max()))


@contextlib.contextmanager
def _skip_where_sglang_needs_an_accelerator():
    """SGLang 0.5.22's compressed-tensors MoE path asks get_device() for an accelerator, which a CPU
    has not: that release cannot build the layer in simulation (the hook is still patched)."""
    try:
        yield
    except RuntimeError as exc:
        if "No accelerator" not in str(exc):
            raise
        pytest.skip(
            f"SGLang {_release.sglang_version()} asks for an accelerator while building or running the "
            f"compressed-tensors MoE layer, which a CPU cannot simulate: {exc}"
        )


def test_compressed_tensors_layer(ckpt, seam):
    with _skip_where_sglang_needs_an_accelerator():
        _compressed_tensors_layer(ckpt, seam)


def _compressed_tensors_layer(ckpt, seam):
    x, (ids, weights) = activations(T, H), routing(T, E, K)
    layer = sglang_layers.build_compressed_tensors_moe_layer(ckpt, K)
    assert type(layer.scheme).__name__ == "CompressedTensorsW4A4Nvfp4MoE"
    out = ml.moe_forward(layer, x, ids, weights)
    assert torch.equal(
        out, sglang_layers.reference_moe_output(ckpt, x, ids, weights, quantization="compressed-tensors")
    )
    w = sglang_layers.moe_weights(layer)
    assert w["a1_gscale"].shape == (E,) and w["quantization"] == "compressed-tensors"
    assert seam[0]["quant_scales"][1].data_ptr() == layer.w13_weight_scale.data_ptr() == w["w13_sf"].data_ptr()
    assert torch.equal(synthetic.reference_moe_from_weights(w, x, ids, weights), out)
    assert rel(out, dense_moe(ckpt, x, ids, weights)) < 0.3
    # EP rank 1: (E/2,) per-expert activation scales, global ids, only its experts.
    layer1 = sglang_layers.build_compressed_tensors_moe_layer(ckpt, K, ep_size=2, ep_rank=1)
    out1 = ml.moe_forward(layer1, x, ids, weights)
    assert sglang_layers.moe_weights(layer1)["a1_gscale"].shape == (E // 2,)
    assert torch.equal(
        out1,
        sglang_layers.reference_moe_output(
            ckpt, x, ids, weights, ep_size=2, ep_rank=1, quantization="compressed-tensors"
        ),
    )


def _state() -> dict:
    """Every global the context touches: SGLang's runtime context, parallel state, platform facts."""
    parallel = rc.get_parallel()
    return {
        "context": rc._CONTEXT,
        "parallel": rc._PARALLEL,
        "parallel overrides": dict(object.__getattribute__(parallel, "_overrides")),
        "parallel stamp": dict(object.__getattribute__(parallel, "_stamp")),
        "platform overrides": dict(object.__getattribute__(rc.get_platform(), "_overrides")),
        "moe flags": repr(rc._CONTEXT.flags.moe),
        "environ": dict(os.environ),
        "seam": fc._flashinfer_cutlass_fused_moe,
        "active": ml.active_moe_context(),
    }


def test_context_restores_everything(ckpt, seam):
    from sglang.srt.layers.moe.utils import get_moe_runner_backend

    before = _state()
    small = synthetic.make_moe_checkpoint(2, 64, 64, seed=2)
    x, (ids, weights) = activations(4, 64), routing(4, 2, 1)
    layer = ml.build_modelopt_moe_layer(small, 1)  # each call holds, then drops, its own context
    assert _state() == before
    assert torch.equal(ml.moe_forward(layer, x, ids, weights), synthetic.reference_moe_output(small, x, ids, weights))
    assert _state() == before
    with ml.sglang_moe_context(ep_size=2, ep_rank=1) as ctx:
        assert rc.get_context() is ctx.runtime_context and ml.active_moe_context() is ctx
        assert rc.get_platform().is_sm120 and rc.get_platform().is_blackwell
        assert (rc.get_parallel().moe_ep_size, rc.get_parallel().moe_ep_rank, rc.get_parallel().tp_size) == (2, 1, 2)
        assert get_moe_runner_backend().is_flashinfer_cutlass()
        model_dir = ctx.model_dir
        with pytest.raises(ValueError, match="active sglang_moe_context"):
            ml.build_modelopt_moe_layer(ckpt, K)  # other ranks than the context's
        with ml.sglang_moe_context(tp_size=2, tp_rank=1):  # nested, then back to the outer one
            assert rc.get_parallel().moe_tp_rank == 1
        assert rc.get_context() is ctx.runtime_context and rc.get_parallel().moe_ep_rank == 1
    assert not os.path.exists(model_dir)
    assert _state() == before
    with pytest.raises(RuntimeError, match="boom"):
        with ml.sglang_moe_context():
            raise RuntimeError("boom")
    assert _state() == before

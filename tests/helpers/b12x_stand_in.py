"""CPU stand-ins for FlashInfer's B12xMoEWrapper with its conventions: scales in b12x's direction
(input_global_scale = 1/a1, w1_alpha the weight's, folded), block scales as the 6-D MMA view, -1 slots
computed on expert 0 with weight 0 (the poisoning variant multiplies through), its own output buffer
returned as a slice. The numbers come from the oracle (through backends.emulated_moe)."""

from __future__ import annotations

import torch

from sm120_fp4.backends import emulated_moe


def from_mma_view(sf6: torch.Tensor) -> torch.Tensor:
    """The (E, Rp, Cp) swizzled scales behind a 6-D (32, 4, m_tiles, 4, k_tiles, E) view."""
    _, _, mt, _, kt, e = sf6.shape
    return sf6.permute(5, 2, 4, 0, 1, 3).reshape(e, mt * 128, kt * 4)


class StandIn:
    """`fault`: None (healthy), "inverted" (scales read in the cutlass direction), "lossy" (one
    8-column group of one row lost in 2 of every 100 calls), "poison" (a -1 slot computed on expert 0
    with weight 0, multiplied through)."""

    fault: str | None = None
    made: list = []

    def __init__(
        self,
        num_experts,
        top_k,
        hidden_size,
        intermediate_size,
        *,
        use_cuda_graph,
        max_num_tokens,
        output_dtype,
        device,
        activation,
        quant_mode,
        shared_static_workspace=None,
        shared_dynamic_workspace=None,
        shared_output=None,
    ):
        assert use_cuda_graph and quant_mode == "nvfp4" and output_dtype == torch.bfloat16
        self.activation = {"silu": "swiglu", "relu2": "relu2"}[activation]
        self._static_workspace = (
            shared_static_workspace if shared_static_workspace is not None else torch.zeros(4096, dtype=torch.uint8)
        )
        self._dynamic_workspace = shared_dynamic_workspace
        self._moe_output = (
            shared_output
            if shared_output is not None
            else torch.empty(max_num_tokens, hidden_size, dtype=torch.bfloat16)
        )
        self._folded_w1_alpha = self._folded_w1_alpha_key = None
        self.calls = 0
        self._done: dict = {}
        self.top_k = top_k
        type(self).made.append(self)

    def run(self, x, w1, w1_sf, w2, w2_sf, ids, weights, *, w1_alpha, w2_alpha, fc2_input_scale, input_global_scale):
        assert w1_sf.dim() == 6 and w2_sf.dim() == 6 and ids.dtype == torch.int32
        self.calls += 1
        # FlashInfer's keyed fold (0.7.2-0.7.4): a new tensor only when the key changes.
        key = (w1_alpha.data_ptr(), input_global_scale.data_ptr(), w1_alpha._version, input_global_scale._version)
        if self._folded_w1_alpha is None or self._folded_w1_alpha_key != key:
            self._folded_w1_alpha, self._folded_w1_alpha_key = w1_alpha * input_global_scale, key
        if self.fault == "inverted":  # read as cutlass's encode scales
            a1, a2, w13_alpha = input_global_scale, fc2_input_scale, w1_alpha / input_global_scale
        else:
            a1, a2, w13_alpha = 1 / input_global_scale, 1 / fc2_input_scale, self._folded_w1_alpha
        out = self._moe_output[: x.shape[0]]
        args = (
            w1,
            from_mma_view(w1_sf).view(torch.float8_e4m3fn),
            w13_alpha,
            w2,
            from_mma_view(w2_sf).view(torch.float8_e4m3fn),
            w2_alpha,
            a1.reshape(-1),
            a2.reshape(-1),
        )
        if self.fault == "lossy":  # as fast as a GPU's call: each distinct input's output computed once
            key = tuple(t.contiguous().view(torch.uint8).numpy().tobytes() for t in (x, ids, weights, w13_alpha))
            if key not in self._done:
                self._done[key] = emulated_moe(x, ids, weights, *args, self.activation, x.dtype, out).clone()
            out.copy_(self._done[key])
        else:
            emulated_moe(x, ids, weights, *args, self.activation, x.dtype, out)
        if self.fault == "poison":  # a -1 slot's row computed on expert 0, times weight 0: 0 x inf = NaN
            expert0_finite = torch.isfinite(w13_alpha[0])
            poisoned = (ids < 0).any(dim=1, keepdim=True) & ~expert0_finite
            out.copy_(torch.where(poisoned, torch.full_like(out, float("nan")), out))
        if self.fault == "lossy" and self.calls % 100 in (37, 81):
            out[0, 8:16] = 0
        return out

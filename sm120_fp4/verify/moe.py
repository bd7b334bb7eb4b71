"""The fused-MoE self-test: cases over experts, routing and batch sizes, against the MoE oracle."""

from __future__ import annotations

import functools
import time
from typing import Callable, Literal

import torch
from pydantic import BaseModel

from .. import backends, nvfp4
from ..devices import Device
from .data import structured_activations
from .engine import Bounds, Case, SelfTestReport, finish, refuse_inside_capture, report_for, rolled, sweep

__all__ = [
    "MoeCase",
    "MoeConfig",
    "MOE_BOUNDS",
    "REPEAT_CALLS",
    "REPEAT_MAX_TOKENS",
    "ExpertCache",
    "DEFAULT_MOE_CONFIG",
    "SIMULATION_MOE_CONFIG",
    "moe_routing",
    "moe_cases",
    "run_moe",
]


# ---- NVFP4 fused MoE -------------------------------------------------------------------------

# Per output row: a token's k routed rows are summed, each rounded to the output dtype, and the
# intermediate is re-quantized to FP4, where a kernel may round before quantizing (FlashInfer
# rounds it to the output dtype first: see nvfp4/reference.py). That rounding point moves some rows by up to
# ~10%: each case computes the oracle both ways and widens each row's bound by twice their
# difference on that row (its "slack"), so the bound neither trips on the kernel's rounding nor
# hides a dropped slot, a dropped expert, ignored routing weights or swapped gate/up halves.
# Each row's 8-column groups are checked too (Bounds.column_group): a kernel that loses one group in
# a wide row (H=7168) stays inside the row bound; a bf16 sum of the k slots stays far inside the group's.
MOE_BOUNDS = Bounds(max_rel_err=1e-2, max_row_rel_err=5e-2, column_group=8)
# The repeat probe: calls of one decode-sized batch in a row, the worst of them judged (an intermittent
# loss: a kernel whose atomic top-k sum drops a column group in 2 of 100 calls).
REPEAT_CALLS = 100
REPEAT_MAX_TOKENS = 8  # the batch sizes probed so (cheap: the oracle's answer is computed once)


class MoeCase(BaseModel):
    """One fused-MoE call of a self-test: the layer (E, H, I, activation), the batch and its routing.

    `routing`: "balanced" gives every expert rows, and (tokens >= experts) lets every expert lead
    some token, carrying most of its output; "skewed" puts slot 0 of every token on one
    expert (>= 128 rows there when tokens >= 128: a kernel's second 64-row half of a tile is
    exercised); "random" picks k distinct experts per token; "padded" adds SGLang's -1 drop
    sentinel (slots a kernel must skip: padding rows, other ranks' experts).
    """

    experts: int
    hidden: int
    intermediate: int
    activation: Literal["swiglu", "relu2"]
    top_k: int
    tokens: int
    dtype: Literal["bfloat16", "float16"]
    routing: Literal["balanced", "skewed", "random", "padded"]

    def label(self) -> str:
        return (
            f"T={self.tokens} top_k={self.top_k} E={self.experts} H={self.hidden} I={self.intermediate} "
            f"{self.activation} {self.dtype} {self.routing}"
        )


class MoeConfig(BaseModel):
    """The cases of one MoE self-test."""

    cases: tuple[MoeCase, ...]


def _moe_grid(experts, hidden, inter, activation, *rows) -> tuple[MoeCase, ...]:
    return tuple(
        MoeCase(
            experts=experts,
            hidden=hidden,
            intermediate=inter,
            activation=activation,
            top_k=k,
            tokens=t,
            dtype=d,
            routing=r,
        )
        for k, t, d, r in rows
    )


# 256 experts every one of which gets rows, >= 128 rows on one expert, top-k 1 and 8, T from 1 to
# 1024, H and I on (128) and off (160, 96) multiples of 128, swiglu and relu2, bf16 and fp16.
DEFAULT_MOE_CONFIG = MoeConfig(
    cases=(
        *_moe_grid(
            256,
            128,
            128,
            "swiglu",
            (8, 1024, "bfloat16", "balanced"),
            (8, 160, "bfloat16", "skewed"),
            (8, 1, "bfloat16", "random"),
            (8, 7, "float16", "random"),
            (1, 512, "bfloat16", "balanced"),
            (1, 300, "float16", "skewed"),
        ),
        *_moe_grid(16, 160, 96, "swiglu", (2, 130, "float16", "skewed"), (2, 5, "bfloat16", "random")),
        *_moe_grid(
            16,
            160,
            96,
            "relu2",
            (2, 130, "bfloat16", "skewed"),
            (1, 33, "float16", "random"),
            (2, 40, "bfloat16", "padded"),
        ),
    )
)

# For a simulated CPU device (the oracle checked against itself: the wiring, not a kernel): the
# same kinds of cases on smaller layers.
SIMULATION_MOE_CONFIG = MoeConfig(
    cases=(
        *_moe_grid(
            32,
            128,
            64,
            "swiglu",
            (8, 64, "bfloat16", "balanced"),
            (4, 160, "bfloat16", "skewed"),
            (1, 130, "float16", "skewed"),
        ),
        *_moe_grid(8, 160, 96, "relu2", (2, 9, "bfloat16", "random"), (2, 12, "float16", "padded")),
    )
)

_moe_weight_cache: dict[tuple, nvfp4.MoeWeights] = {}


def _moe_weights(
    experts: int, hidden: int, inter: int, activation: str, device: torch.device, seed: int
) -> nvfp4.MoeWeights:
    """Seeded NVFP4 expert weights (each expert its own global scale) in reference_moe_fp4's layout;
    every 11th row zero (a zero output column of FC2, a dead channel of FC1) and another small
    enough for subnormal E4M3 block scales."""
    key = (experts, hidden, inter, activation, str(device), seed)
    if key in _moe_weight_cache:
        return _moe_weight_cache[key]
    gen = torch.Generator().manual_seed(seed)
    rows13 = 2 * inter if activation == "swiglu" else inter
    a1 = torch.tensor(nvfp4.E4M3_MAX * nvfp4.E2M1_MAX / 4.0, device=device)  # activations of |x| <= 4
    a2 = torch.tensor(nvfp4.E4M3_MAX * nvfp4.E2M1_MAX / 0.5, device=device)

    def experts_of(rows: int, cols: int, act_gsf: torch.Tensor):
        packed, scales, alphas = [], [], []
        for e in range(experts):
            w = torch.randn(rows, cols, generator=gen) * 0.05 * (1 + e % 7 / 7)
            row = torch.arange(rows).unsqueeze(1) % 11  # zeroed rows (zero output columns), rows of subnormal scales
            w = (
                torch.where(row == 3, torch.zeros_like(w), torch.where(row == 7, w * 2e-5, w))
                .to(torch.bfloat16)
                .to(device)
            )
            gsf = nvfp4.global_scale(w)
            q, sf = nvfp4.quantize(w, gsf)
            packed.append(q)
            scales.append(sf)
            alphas.append(1.0 / (act_gsf * gsf))
        return torch.stack(packed), torch.stack(scales), torch.stack(alphas).float()

    w13, w13_sf, w13_alpha = experts_of(rows13, hidden, a1)
    w2, w2_sf, w2_alpha = experts_of(hidden, inter, a2)
    weights = nvfp4.MoeWeights(
        w13, w13_sf, w13_alpha, w2, w2_sf, w2_alpha, a1.reshape(1).float(), a2.reshape(1).float()
    )
    _moe_weight_cache.clear()  # keep one layer's weights: a self-test walks its cases layer by layer
    _moe_weight_cache[key] = weights
    return weights


def moe_routing(
    tokens: int, top_k: int, experts: int, routing: str, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids int32 (T, k), topk_weights float32 (T, k)) with distinct experts per token, weights
    in [0.1, 1] that do not sum to 1 (a kernel that ignores or renormalises them is seen).
    "padded" is "random" with SGLang's -1 drop sentinel in the last quarter of the tokens (every
    slot: the padding rows of a captured graph) and in the last slot of every fifth token.
    "balanced": token t leads with expert perm[t % E] (weight in [0.8, 1]) and has the next k - 1
    experts of a random permutation in its other slots (weights in [0.02, 0.1]), so with T >= E
    every expert leads some token and carries most of that token's output: an expert that is
    dropped or computed wrong shows in those rows, whatever the other slots add."""
    if routing == "balanced":
        perm = torch.randperm(experts, generator=gen)
        ids = perm[(torch.arange(tokens).unsqueeze(1) + torch.arange(top_k)) % experts]
        weights = torch.cat(
            (
                0.8 + 0.2 * torch.rand(tokens, 1, generator=gen),
                0.02 + 0.08 * torch.rand(tokens, top_k - 1, generator=gen),
            ),
            dim=1,
        )
        return ids.to(torch.int32), weights.float()
    # A random permutation of the experts per token (the order of uniform draws), k of them:
    # one draw for every token at once, not one randperm call per token.
    ids = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :top_k]
    if routing == "skewed":
        hot = int(torch.randint(experts, (1,), generator=gen))
        ids[ids == hot] = ids[:, :1].expand_as(ids)[ids == hot]  # keep ids distinct per token
        ids[:, 0] = hot
    elif routing == "padded" and tokens > 1:
        ids[torch.arange(tokens) % 5 == 4, -1] = -1
        ids[tokens - tokens // 4 :] = -1
    weights = 0.1 + 0.9 * torch.rand(tokens, top_k, generator=gen)
    return ids.to(torch.int32), weights.float()


class ExpertCache(dict):
    """A reference_moe_fp4 `weight_cache` that keeps only the experts in `keep`: a check that routes
    to every one of a layer's experts dequantizes the others per call instead of holding them all."""

    def __init__(self, keep) -> None:
        super().__init__()
        self.keep = set(keep)

    def __setitem__(self, key, value) -> None:
        if key[1] in self.keep:
            super().__setitem__(key, value)


def moe_cases(
    fn: Callable,
    weights: nvfp4.MoeWeights,
    activation: str,
    plans: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]],
    bounds: Bounds = MOE_BOUNDS,
    cache: dict | None = None,
    *,
    first_expert: int = 0,
    served_ids: bool = False,
    mode: str = "w4a4",
    reference_weights: nvfp4.MoeWeights | None = None,
    repeat_tokens: int = 0,
    poison_expert0: bool = False,
) -> list[Case]:
    """Calls of `fn` with `weights`, one per plan (label, x, topk_ids,
    topk_weights): each checked against the oracle, `out` poisoned first. `cache` keeps the
    references' dequantized experts for these weights (one dict per weights).

    The plans' ids are as SGLang serves them: global expert ids (this rank's experts are
    `first_expert` .. `first_expert` + E - 1, any other belongs to another expert-parallel rank) and
    SGLang's -1 drop sentinel. `fn` gets them in the backend convention (this rank's local ids, -1
    for every other slot: flashinfer.moe_call_to_convention), or unchanged with `served_ids` (a call
    through SGLang's seam). The oracle computes this rank's slots only: the others add nothing.

    `mode` is what the backend computes: "w4a4" against the oracle with quantized activations,
    "w4a16" against its W4A16 mode (``quantize_activations=False``, each expert's alpha times the
    activation scale it was made for: 1 / the weight's global scale). `reference_weights` (default
    `weights`) are what the oracle reads: the checkpoint's bytes where the served ones were converted.

    Each plan of at most `repeat_tokens` tokens is also called REPEAT_CALLS times in a row, the worst
    call judged (`_repeated`). `poison_expert0` adds a call whose local expert 0 yields non-finite rows
    (its FC1 alpha infinite) while no token routes to it and -1 slots abound: a kernel that computes a
    -1 slot on expert 0 with weight 0 gets 0 x inf = NaN in rows that must stay finite."""
    cases = []
    cache = {} if cache is None else cache  # shared across plans: the weights are the same
    ref_w = reference_weights or weights
    experts = weights.w13.shape[0]
    for label, x, ids, topk_weights in plans:
        local = ids.long() - first_expert
        mine = (ids >= 0) & (local >= 0) & (local < experts)
        call_ids = ids if served_ids else torch.where(mine, local, torch.full_like(local, -1)).to(torch.int32)
        routed = (
            x,
            torch.where(mine, local, torch.zeros_like(local)),
            torch.where(mine, topk_weights, torch.zeros_like(topk_weights)),
        )
        if mode == "w4a16":
            w4a16 = ref_w._replace(
                w13_alpha=ref_w.w13_alpha * ref_w.a1_gscale,
                w2_alpha=ref_w.w2_alpha * ref_w.a2_gscale,
                a1_gscale=None,
                a2_gscale=None,
            )
            ref = nvfp4.reference_moe_fp4(
                *routed,
                *w4a16,
                activation=activation,
                out_dtype=torch.float32,
                quantize_activations=False,
                weight_cache=cache,
            )
            slack = None  # nothing is re-quantized: no rounding point the oracle cannot decide
        else:
            # The reference, and the kernel's rounding of the intermediate (one pass: FC1 shared).
            ref, kernel_rounding = nvfp4.reference_moe_fp4_roundings(
                *routed,
                *ref_w,
                activation=activation,
                out_dtype=torch.float32,
                intermediate_dtypes=(None, x.dtype),
                weight_cache=cache,
            )
            slack = (kernel_rounding - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-30)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        args = (x, call_ids, topk_weights, *weights)
        case = Case(
            x.shape[0],
            x.shape[1],
            weights.w2.shape[2] * 2,
            functools.partial(fn, *args, activation, x.dtype, out),
            ref,
            inputs=tuple(a for a in args if isinstance(a, torch.Tensor)),
            out=out,
            label=label,
            bounds=bounds,
            slack=slack,
        )
        case.twin = functools.partial(_rolled_tokens, case, fn, args, activation, out)
        cases.append(case)
        if x.shape[0] <= repeat_tokens:
            cases.append(
                Case(
                    x.shape[0],
                    x.shape[1],
                    case.k,
                    functools.partial(_repeated, fn, args, activation, out, ref),
                    ref,
                    inputs=case.inputs,
                    out=out,
                    label=f"{label} x{REPEAT_CALLS} in a row (worst judged)",
                    bounds=bounds,
                    slack=slack,
                )
            )
    if poison_expert0 and plans:
        poisoned = _poisoned_expert0_case(
            fn, weights, ref_w, activation, plans[0][1], bounds, cache, first_expert, served_ids, mode
        )
        if poisoned is not None:
            cases.append(poisoned)
    return cases


def _group_error(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """0-dim: the largest error of an 8-column group (else of a row) against its share of the row's
    norm; inf where `out` is not finite. No host synchronisation."""
    rows, cols = ref.shape
    group = 8 if cols % 8 == 0 else cols
    o, r = out.float().reshape(rows, -1, group), ref.float().reshape(rows, -1, group)
    share = r.reshape(rows, -1).norm(dim=1).reshape(rows, 1) * (group / cols) ** 0.5
    err = (o - r).norm(dim=2) / (r.norm(dim=2) + share).clamp_min(1e-30)
    return torch.nan_to_num(err, nan=float("inf")).amax()


def _repeated(fn: Callable, args: tuple, activation: str, out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """REPEAT_CALLS calls of one batch in a row into a buffer of their own; `out` gets the worst of
    them (by _group_error against the oracle), and every call must return its buffer."""
    buf = torch.empty_like(out)
    worst = torch.full((), -1.0, dtype=torch.float32, device=out.device)
    for i in range(REPEAT_CALLS):
        buf.fill_(float("nan"))
        got = fn(*args, activation, args[0].dtype, buf)
        if got is not buf:
            raise RuntimeError(f"call {i + 1} of {REPEAT_CALLS} in a row returned a tensor other than `out`")
        err = _group_error(buf, ref)
        out.copy_(torch.where(err > worst, buf, out))
        worst = torch.maximum(worst, err)
    return out


def _poisoned_expert0_case(
    fn, weights, ref_w, activation, x_like, bounds, cache, first, served_ids, mode
) -> Case | None:
    """The call `poison_expert0` adds (see moe_cases); None where the layer has too few experts."""
    experts = weights.w13.shape[0]
    top_k = 2 if experts > 2 else 1
    if experts < 2:
        return None
    tokens = 4
    gen = torch.Generator().manual_seed(7)
    # float32 named: SGLang loads a model under torch's default dtype set to the model's (bf16).
    local = 1 + torch.rand(tokens, experts - 1, generator=gen, dtype=torch.float32).argsort(dim=1)[:, :top_k]  # not 0
    topk_weights = (0.1 + 0.9 * torch.rand(tokens, top_k, generator=gen, dtype=torch.float32)).to(x_like.device)
    local[:, -1] = -1  # every token: a -1 slot (b12x computes it on expert 0, weight 0)
    local[-1] = -1  # a padding row: every slot -1, a zero row
    local = local.to(torch.int32).to(x_like.device)
    x = structured_activations(tokens, x_like.shape[1], 4.0, gen).to(x_like.dtype).to(x_like.device)
    alpha = weights.w13_alpha.clone()
    alpha[0] = float("inf")
    poisoned = weights._replace(w13_alpha=alpha)
    ids = torch.where(local >= 0, local + first, local) if served_ids else local
    [case] = moe_cases(
        fn,
        poisoned,
        activation,
        [("expert 0 non-finite, -1 slots pointing nowhere", x, ids, topk_weights)],
        bounds,
        cache,
        first_expert=first,
        served_ids=served_ids,
        mode=mode,
        reference_weights=ref_w,
    )
    return case


def _rolled_tokens(case: Case, fn: Callable, args: tuple, activation: str, out: torch.Tensor) -> Case:
    """The same MoE call with its tokens rolled by one (their activations, routing and weights)."""
    moved = tuple(a.roll(1, 0) for a in args[:3]) + args[3:]
    invoke = functools.partial(fn, *moved, activation, args[0].dtype, out)
    return rolled(case, invoke, tuple(a for a in moved if isinstance(a, torch.Tensor)))


def _sizes(case: MoeCase) -> tuple:
    return case.experts, case.hidden, case.intermediate, case.activation, getattr(torch, case.dtype)


def _within(accepts: Callable, case: MoeCase) -> MoeCase | None:
    """`case`, or the nearest case a backend with limits accepts (bf16; H and I rounded up to 128),
    or None."""
    if accepts(*_sizes(case)) is None:
        return case
    near = case.model_copy(
        update={
            "dtype": "bfloat16",
            "hidden": -(-case.hidden // 128) * 128,
            "intermediate": -(-case.intermediate // 128) * 128,
        }
    )
    return near if accepts(*_sizes(near)) is None else None


def run_moe(
    backend: str, device: Device, config: MoeConfig | None = None, *, seed: int = 0, bounds: Bounds | None = None
) -> SelfTestReport:
    """Self-test NVFP4 fused-MoE `backend` on `device` over `config` (default DEFAULT_MOE_CONFIG);
    never raises for a bad kernel. Two passes, every call checked per output row against
    nvfp4.reference_moe_fp4 (zero rows, non-finite values, per-row relative error), `out` returned,
    inputs unchanged."""
    refuse_inside_capture("self-test", "before")
    config = config or DEFAULT_MOE_CONFIG
    bounds = bounds or MOE_BOUNDS
    report = report_for(backend, device, config="NVFP4 fused MoE")
    start = time.perf_counter()
    try:
        fn = backends.resolve_moe(backend)
    except Exception as exc:
        report.reason = f"could not load MoE backend {backend!r}: {type(exc).__name__}: {exc}"
        return report
    tdev = device.torch_device
    mode = backends.get_moe(backend).mode
    accepts = backends.get_moe(backend).accepts
    if accepts is not None:
        kept = [c for c in (_within(accepts, c) for c in config.cases) if c is not None]
        if not kept:
            report.reason = (
                f"MoE backend {backend!r} accepts none of the self-test's layers: {accepts(*_sizes(config.cases[0]))}"
            )
            return report
        config = MoeConfig(cases=tuple(kept))
    gen = torch.Generator().manual_seed(seed)
    cases: list[Case] = []
    caches: dict[tuple, dict] = {}  # per layer shape: the same seeded weights
    for i, case in enumerate(config.cases):
        weights = _moe_weights(case.experts, case.hidden, case.intermediate, case.activation, tdev, seed + 17)
        ids, topk_weights = moe_routing(case.tokens, case.top_k, case.experts, case.routing, gen)
        x = structured_activations(case.tokens, case.hidden, 4.0, gen).to(getattr(torch, case.dtype)).to(tdev)
        cache = caches.setdefault((case.experts, case.hidden, case.intermediate, case.activation), {})
        cases += moe_cases(
            fn,
            weights,
            case.activation,
            [(case.label(), x, ids.to(tdev), topk_weights.to(tdev))],
            bounds,
            cache,
            mode=mode,
            repeat_tokens=REPEAT_MAX_TOKENS,
            poison_expert0=i == 0,
        )
    return finish(
        report,
        sweep(
            cases, Bounds(timeout_s=bounds.timeout_s), tdev, where=f" of MoE backend {backend!r} on {device.label()}"
        ),
        start,
    )

"""The fused-MoE self-test: cases over experts, routing and batch sizes, against the MoE oracle."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, replace
from typing import Callable, Literal

import torch
from pydantic import BaseModel

from .. import backends, nvfp4
from ..devices import CHECK_MEMORY_BYTES, Device
from .data import structured_activations
from .engine import Bounds, Case, SelfTestReport, finish, load_backend, refuse_inside_capture, report_for, sweep

__all__ = [
    "MoeCase",
    "MoeConfig",
    "MOE_BOUNDS",
    "REPEAT_CALLS",
    "REPEAT_MIN",
    "ProbeBudget",
    "REPEAT_MAX_TOKENS",
    "ExpertCache",
    "DEFAULT_MOE_CONFIG",
    "SIMULATION_MOE_CONFIG",
    "moe_routing",
    "moe_cases",
    "run_moe",
]

# A kernel may round the intermediate to the output dtype before re-quantizing it (FlashInfer does, moving
# rows by up to ~10%): each row's bound is widened by twice the oracle's two ways' difference there (its
# "slack"). 8-column groups are checked too: one group lost in a wide row (H=7168) stays inside the row bound.
MOE_BOUNDS = Bounds(max_rel_err=1e-2, max_row_rel_err=5e-2, column_group=8)
REPEAT_CALLS = 100  # calls of one decode batch in a row at most, the worst judged (an atomic sum losing 2 in 100)
REPEAT_MIN = 2  # ... and at least, whatever the time budget (Bounds.probe_s) says
REPEAT_MAX_TOKENS = 8  # the batch sizes probed so (cheap: the oracle's answer is computed once)


class MoeCase(BaseModel):
    """One fused-MoE call of a self-test: the layer (E, H, I, activation), the batch and its routing."""

    experts: int
    hidden: int
    intermediate: int
    activation: Literal["swiglu", "relu2"]
    top_k: int
    tokens: int
    dtype: Literal["bfloat16", "float16"]
    # balanced: every expert leads some token (T >= E); skewed: slot 0 of every token on one expert (>= 128
    # rows there: a tile's second half); random: k distinct experts; padded: -1 drop slots.
    routing: Literal["balanced", "skewed", "random", "padded"]

    def label(self) -> str:
        return (
            f"T={self.tokens} top_k={self.top_k} E={self.experts} H={self.hidden} I={self.intermediate} "
            f"{self.activation} {self.dtype} {self.routing}"
        )


class MoeConfig(BaseModel):
    """The cases of one MoE self-test."""

    cases: tuple[MoeCase, ...]


def _moe_grid(layer: tuple, *rows: tuple) -> tuple[MoeCase, ...]:
    """Return the cases of one layer (E, H, I, activation), one per (top_k, tokens, dtype, routing)."""
    return tuple(MoeCase(**dict(zip(MoeCase.model_fields, layer + row))) for row in rows)


# 256 experts every one of which gets rows, >= 128 rows on one expert, top-k 1 and 8, T from 1 to
# 1024, H and I on (128) and off (160, 96) multiples of 128, swiglu and relu2, bf16 and fp16.
DEFAULT_MOE_CONFIG = MoeConfig(
    cases=(
        *_moe_grid(
            (256, 128, 128, "swiglu"),
            (8, 1024, "bfloat16", "balanced"),
            (8, 160, "bfloat16", "skewed"),
            (8, 1, "bfloat16", "random"),
            (8, 7, "float16", "random"),
            (1, 512, "bfloat16", "balanced"),
            (1, 300, "float16", "skewed"),
        ),
        *_moe_grid((16, 160, 96, "swiglu"), (2, 130, "float16", "skewed"), (2, 5, "bfloat16", "random")),
        *_moe_grid(
            (16, 160, 96, "relu2"),
            (2, 130, "bfloat16", "skewed"),
            (1, 33, "float16", "random"),
            (2, 40, "bfloat16", "padded"),
        ),
    )
)

# For a simulated CPU device (the oracle checked against itself: the wiring): smaller layers.
SIMULATION_MOE_CONFIG = MoeConfig(
    cases=(
        *_moe_grid(
            (32, 128, 64, "swiglu"),
            (8, 64, "bfloat16", "balanced"),
            (4, 160, "bfloat16", "skewed"),
            (1, 130, "float16", "skewed"),
        ),
        *_moe_grid((8, 160, 96, "relu2"), (2, 9, "bfloat16", "random"), (2, 12, "float16", "padded")),
    )
)


def _moe_experts(gen, experts: int, rows: int, cols: int, act_gsf: torch.Tensor, device) -> tuple:
    """Return seeded experts (packed, scales, alphas), each with its own global scale."""
    made = []
    for e in range(experts):
        w = torch.randn(rows, cols, generator=gen) * 0.05 * (1 + e % 7 / 7)
        row = torch.arange(rows).unsqueeze(1) % 11  # zeroed rows (zero output columns), rows of subnormal scales
        w = torch.where(row == 3, torch.zeros_like(w), torch.where(row == 7, w * 2e-5, w))
        w = w.to(torch.bfloat16).to(device)
        gsf = nvfp4.global_scale(w)
        q, sf = nvfp4.quantize(w, gsf)
        made.append((q, sf, 1.0 / (act_gsf * gsf)))
    packed, scales, alphas = zip(*made)
    return torch.stack(packed), torch.stack(scales), torch.stack(alphas).float()


@functools.lru_cache(maxsize=1)  # keep one layer's weights: a self-test walks its cases layer by layer
def _moe_weights(
    experts: int, hidden: int, inter: int, activation: str, device: torch.device, seed: int
) -> nvfp4.MoeWeights:
    """Return seeded NVFP4 expert weights in reference_moe_fp4's layout (the last layer's kept)."""
    gen = torch.Generator().manual_seed(seed)
    rows13 = 2 * inter if activation == "swiglu" else inter
    a1 = torch.tensor(nvfp4.E4M3_MAX * nvfp4.E2M1_MAX / 4.0, device=device)  # activations of |x| <= 4
    a2 = torch.tensor(nvfp4.E4M3_MAX * nvfp4.E2M1_MAX / 0.5, device=device)
    w13 = _moe_experts(gen, experts, rows13, hidden, a1, device)
    w2 = _moe_experts(gen, experts, hidden, inter, a2, device)
    return nvfp4.MoeWeights(*w13, *w2, a1.reshape(1).float(), a2.reshape(1).float())


def moe_routing(
    tokens: int, top_k: int, experts: int, routing: str, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (topk_ids int32 (T, k), topk_weights float32 (T, k)) with distinct experts per token."""
    # Weights in [0.1, 1] that do not sum to 1: a kernel that ignores or renormalises them is seen.
    if routing == "balanced":
        # Token t leads with expert perm[t % E] (weight 0.8..1), the next k - 1 in its other slots (0.02..0.1).
        perm = torch.randperm(experts, generator=gen)
        ids = perm[(torch.arange(tokens).unsqueeze(1) + torch.arange(top_k)) % experts]
        lead = 0.8 + 0.2 * torch.rand(tokens, 1, generator=gen)
        weights = torch.cat((lead, 0.02 + 0.08 * torch.rand(tokens, top_k - 1, generator=gen)), dim=1)
        return ids.to(torch.int32), weights.float()
    # A random permutation of the experts per token (the order of uniform draws), k of them.
    ids = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :top_k]
    if routing == "skewed":
        hot = int(torch.randint(experts, (1,), generator=gen))
        ids[ids == hot] = ids[:, :1].expand_as(ids)[ids == hot]  # keep ids distinct per token
        ids[:, 0] = hot
    elif routing == "padded" and tokens > 1:
        # SGLang's -1 drop: every slot of the last quarter (graph padding), the last slot of every fifth token.
        ids[torch.arange(tokens) % 5 == 4, -1] = -1
        ids[tokens - tokens // 4 :] = -1
    weights = 0.1 + 0.9 * torch.rand(tokens, top_k, generator=gen)
    return ids.to(torch.int32), weights.float()


class ExpertCache(dict):
    """A reference_moe_fp4 `weight_cache` that keeps only the experts in `keep`, a quarter of a check's memory at most."""

    def __init__(self, keep) -> None:
        super().__init__()
        self.keep, self.bytes = set(keep), 0

    def __setitem__(self, key, value) -> None:
        if key[1] in self.keep and self.bytes + value.nbytes <= CHECK_MEMORY_BYTES // 4:
            self.bytes += value.nbytes
            super().__setitem__(key, value)


def _moe_reference(routed: tuple, ref_w: nvfp4.MoeWeights, activation: str, mode: str, cache: dict) -> tuple:
    """Return the oracle's float32 output for `routed` and its per-row slack (None for W4A16), in slices of tokens."""
    # Tokens are independent: slices whose working set (each slot's FC1 and FC2 rows, twice) stays below 3/8
    # of the check's memory bound (the expert cache a quarter); the same numbers as one call.
    x = routed[0]
    per_token = routed[1].shape[1] * (4 * x.shape[1] + 8 * ref_w.w13.shape[1]) + 12 * x.shape[1]
    step = max(1, CHECK_MEMORY_BYTES * 3 // 8 // per_token)
    if x.shape[0] <= step:
        return _moe_reference_rows(routed, ref_w, activation, mode, cache)
    parts = [
        _moe_reference_rows([t[lo : lo + step] for t in routed], ref_w, activation, mode, cache)
        for lo in range(0, x.shape[0], step)
    ]
    refs, slacks = zip(*parts)
    return torch.cat(refs), None if slacks[0] is None else torch.cat(slacks)


def _moe_reference_rows(routed, ref_w: nvfp4.MoeWeights, activation: str, mode: str, cache: dict) -> tuple:
    if mode == "w4a16":
        # Each expert's alpha times the activation scale it was made for: 1 / the weight's global scale.
        alphas = dict(w13_alpha=ref_w.w13_alpha * ref_w.a1_gscale, w2_alpha=ref_w.w2_alpha * ref_w.a2_gscale)
        w4a16 = ref_w._replace(**alphas, a1_gscale=None, a2_gscale=None)
        ref = nvfp4.reference_moe_fp4(
            *routed, *w4a16, activation, torch.float32, quantize_activations=False, weight_cache=cache
        )
        return ref, None  # nothing is re-quantized: no rounding point the oracle cannot decide
    # The reference, and the kernel's rounding of the intermediate (one pass: FC1 shared).
    ref, kernel_rounding = nvfp4.reference_moe_fp4_roundings(
        *routed, *ref_w, activation, torch.float32, intermediate_dtypes=(None, routed[0].dtype), weight_cache=cache
    )
    return ref, (kernel_rounding - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-30)


def _local(ids: torch.Tensor, first_expert: int, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return `ids` as this rank's local expert ids, and where a slot is one of this rank's experts."""
    local = ids.long() - first_expert
    return local, (ids >= 0) & (local >= 0) & (local < experts)


def _batch_key(tensors) -> tuple:
    """Return what plans that are the leading tokens of one batch share: their tensors' storages (each from its
    start, contiguous); a plan with any other layout is its own batch."""
    if all(t.is_contiguous() and t.storage_offset() == 0 for t in tensors):
        return tuple(t.untyped_storage().data_ptr() for t in tensors)
    return tuple(id(t) for t in tensors)


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
    budget: ProbeBudget | None = None,
) -> list[Case]:
    """Return the checked calls of `fn` with `weights`, one per plan (label, x, topk_ids, topk_weights)."""
    # Plan ids are SGLang's: global (this rank's are first_expert .. + E - 1), -1 drops. `fn` gets local ids,
    # -1 for every other slot, or the plan's with `served_ids`; the oracle computes this rank's slots only,
    # from `reference_weights` (the checkpoint's bytes). Plans of <= `repeat_tokens` tokens are also repeated,
    # within `budget` (default: one of `bounds.probe_s` for these plans). Probes run in the first pass only.
    # Plans whose x, ids and weights are the leading tokens of one batch (the same storages, from their start) share
    # its oracle result and output buffer, views of the longest: tokens are independent, so a batch's first M tokens
    # are a batch of M, and the oracle runs once (a layer check's sweep of every M to 8192: its memory and time).
    cases = []
    budget = budget or ProbeBudget(bounds.probe_s)
    cache = {} if cache is None else cache  # shared across plans: the weights are the same
    ref_w = reference_weights or weights
    experts = weights.w13.shape[0]
    longest: dict[tuple, tuple] = {}  # batch key -> its longest plan's (x, ids, weights)
    for _, *tensors in plans:
        key = _batch_key(tensors)
        if key not in longest or tensors[0].shape[0] > longest[key][0].shape[0]:
            longest[key] = tuple(tensors)
    shared: dict[tuple, tuple] = {}  # batch key -> the (reference, slack, out) of its longest plan
    for label, x, ids, topk_weights in plans:
        local, mine = _local(ids, first_expert, experts)
        call_ids = ids if served_ids else torch.where(mine, local, -1).to(torch.int32)
        key, m = _batch_key((x, ids, topk_weights)), x.shape[0]
        if key not in shared:
            whole, whole_ids, whole_weights = longest[key]
            local, mine = _local(whole_ids, first_expert, experts)
            routed = (whole, torch.where(mine, local, 0), torch.where(mine, whole_weights, 0.0))
            shared[key] = (*_moe_reference(routed, ref_w, activation, mode, cache), torch.empty_like(whole))
        ref, slack, out = (t if t is None else t[:m] for t in shared[key])
        args = (x, call_ids, topk_weights, *weights)
        inputs = tuple(a for a in args if isinstance(a, torch.Tensor))
        n, k = x.shape[1], weights.w2.shape[2] * 2
        call = functools.partial(fn, *args, activation, x.dtype, out)
        case = Case(m, n, k, call, ref, inputs=inputs, out=out, label=label, bounds=bounds, slack=slack)
        case.twin = functools.partial(_rolled_tokens, fn, args, activation, out)
        cases.append(case)
        if m <= repeat_tokens:
            probe = _Repeat(fn, args, activation, out, ref, budget)
            label = f"{label} up to x{REPEAT_CALLS} in a row (worst judged)"
            extra = dict(once=True, repeats=lambda p=probe: p.ran)
            cases.append(
                Case(m, n, k, probe, ref, inputs=inputs, out=out, label=label, bounds=bounds, slack=slack, **extra)
            )
    if poison_expert0 and plans:
        poisoned = _poisoned_expert0_plan(weights, plans[0][1], first_expert, served_ids)
        if poisoned is not None:
            kept = dict(first_expert=first_expert, served_ids=served_ids, mode=mode, reference_weights=ref_w)
            [probe] = moe_cases(fn, poisoned[0], activation, [poisoned[1]], bounds, cache, **kept)
            cases.append(replace(probe, twin=None, once=True))  # one call: the poison is in the weights, not in state
    return cases


def _group_error(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Return (0-dim, no host sync) the largest 8-column group error against its share; inf if not finite."""
    rows, cols = ref.shape
    group = 8 if cols % 8 == 0 else cols
    o, r = out.float().reshape(rows, -1, group), ref.float().reshape(rows, -1, group)
    share = r.reshape(rows, -1).norm(dim=1).reshape(rows, 1) * (group / cols) ** 0.5
    err = (o - r).norm(dim=2) / (r.norm(dim=2) + share).clamp_min(1e-30)
    return torch.nan_to_num(err, nan=float("inf")).amax()


@dataclass
class ProbeBudget:
    """The seconds the repeat probes of one check may take together, shared out as they run."""

    seconds: float
    probes: int = 0  # probes not run yet
    spent: float = 0.0

    def share(self) -> float:
        """Return what the next probe may take: an equal part of what is left."""
        return max(0.0, self.seconds - self.spent) / max(1, self.probes)


class _Repeat:
    """The repeat probe of one decode batch: calls in a row, the worst (by _group_error) left in `out`."""

    def __init__(self, fn: Callable, args: tuple, activation: str, out: torch.Tensor, ref: torch.Tensor, budget):
        self.fn, self.args, self.activation, self.out, self.ref, self.budget = fn, args, activation, out, ref, budget
        self.ran, self.counted = 0, True  # calls made by the last run; whether the budget still counts this one
        budget.probes += 1

    def _call(self, i: int, buf: torch.Tensor) -> None:
        buf.fill_(float("nan"))
        if self.fn(*self.args, self.activation, self.args[0].dtype, buf) is not buf:
            raise RuntimeError(f"call {i + 1} in a row returned a tensor other than `out`")

    def __call__(self) -> torch.Tensor:
        """Make REPEAT_CALLS calls, or as many as this probe's share of the budget holds (at least REPEAT_MIN)."""
        # The second call is timed (the device synchronised around it): the first may include a first-use cost.
        out, budget = self.out, self.budget
        share, limit = budget.share(), REPEAT_CALLS
        if self.counted:
            self.counted, budget.probes = False, budget.probes - 1
        buf = torch.empty_like(out)
        worst = torch.full((), -1.0, dtype=torch.float32, device=out.device)
        self.ran = 0
        for i in range(REPEAT_CALLS):
            if i == 1:
                _synchronize(out.device)
                start = time.perf_counter()
            self._call(i, buf)
            err = _group_error(buf, self.ref)
            out.copy_(torch.where(err > worst, buf, out))
            worst = torch.maximum(worst, err)
            self.ran = i + 1
            if i == 1:
                _synchronize(out.device)
                took = time.perf_counter() - start
                limit = min(REPEAT_CALLS, max(REPEAT_MIN, int(share / max(took, 1e-9))))
                budget.spent += took * limit
            if self.ran >= limit:
                break
        return out


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _poisoned_expert0_plan(weights, x_like, first: int, served_ids: bool) -> tuple | None:
    """Return weights whose expert 0 yields non-finite rows, and a plan that never routes to it."""
    # A kernel computing a -1 slot on expert 0 with weight 0 gets 0 x inf = NaN. None below 2 experts.
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
    ids = torch.where(local >= 0, local + first, local) if served_ids else local
    plan = ("expert 0 non-finite, -1 slots pointing nowhere", x, ids, topk_weights)
    return weights._replace(w13_alpha=alpha), plan


def _rolled_tokens(fn: Callable, args: tuple, activation: str, out: torch.Tensor, case: Case) -> Case:
    """Return the same MoE call with its tokens rolled by one (their activations, routing and weights)."""
    # Tokens are independent: the reference's rows (and each row's slack) roll with them.
    moved = tuple(a.roll(1, 0) for a in args[:3]) + args[3:]
    invoke = functools.partial(fn, *moved, activation, args[0].dtype, out)
    inputs = tuple(a for a in moved if isinstance(a, torch.Tensor))
    slack = case.slack.roll(1, 0) if case.slack is not None else None
    return replace(case, invoke=invoke, reference=case.reference.roll(1, 0), inputs=inputs, slack=slack, twin=None)


def _sizes(case: MoeCase) -> tuple:
    return case.experts, case.hidden, case.intermediate, case.activation, getattr(torch, case.dtype)


def _within(accepts: Callable, case: MoeCase) -> MoeCase | None:
    """Return `case`, or the nearest one `accepts` takes (bf16; H and I rounded up to 128), or None."""
    if accepts(*_sizes(case)) is None:
        return case
    hidden, inter = -(-case.hidden // 128) * 128, -(-case.intermediate // 128) * 128
    near = case.model_copy(update={"dtype": "bfloat16", "hidden": hidden, "intermediate": inter})
    return near if accepts(*_sizes(near)) is None else None


def _selftest_cases(fn: Callable, mode: str, config: MoeConfig, tdev, seed: int, bounds: Bounds) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    cases: list[Case] = []
    caches: dict[tuple, dict] = {}  # per layer shape: the same seeded weights
    budget = ProbeBudget(bounds.probe_s)  # one check: its repeat probes share one budget
    for i, case in enumerate(config.cases):
        weights = _moe_weights(case.experts, case.hidden, case.intermediate, case.activation, tdev, seed + 17)
        ids, topk_weights = moe_routing(case.tokens, case.top_k, case.experts, case.routing, gen)
        x = structured_activations(case.tokens, case.hidden, 4.0, gen).to(getattr(torch, case.dtype)).to(tdev)
        cache = caches.setdefault((case.experts, case.hidden, case.intermediate, case.activation), {})
        plan = (case.label(), x, ids.to(tdev), topk_weights.to(tdev))
        extra = dict(mode=mode, repeat_tokens=REPEAT_MAX_TOKENS, poison_expert0=i == 0, budget=budget)
        cases += moe_cases(fn, weights, case.activation, [plan], bounds, cache, **extra)
    return cases


def run_moe(
    backend: str, device: Device, config: MoeConfig | None = None, *, seed: int = 0, bounds: Bounds | None = None
) -> SelfTestReport:
    """Return the self-test of fused-MoE `backend` on `device` over `config`; never raise for a bad kernel."""
    refuse_inside_capture("self-test", "before")
    config = config or DEFAULT_MOE_CONFIG
    bounds = bounds or MOE_BOUNDS
    report = report_for(backend, device, config="NVFP4 fused MoE")
    start = time.perf_counter()
    fn = load_backend(report, backends.resolve_moe, f"MoE backend {backend!r}", backend)
    if fn is None:
        return report
    accepts = backends.get_moe(backend).accepts
    if accepts is not None:
        kept = [c for c in (_within(accepts, c) for c in config.cases) if c is not None]
        if not kept:
            why = accepts(*_sizes(config.cases[0]))
            report.reason = f"MoE backend {backend!r} accepts none of the self-test's layers: {why}"
            return report
        config = MoeConfig(cases=tuple(kept))
    tdev = device.torch_device
    cases = _selftest_cases(fn, backends.get_moe(backend).mode, config, tdev, seed, bounds)
    where = f" of MoE backend {backend!r} on {device.label()}"
    return finish(report, sweep(cases, Bounds(timeout_s=bounds.timeout_s), tdev, where=where), start)

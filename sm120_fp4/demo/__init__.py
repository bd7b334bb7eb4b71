"""``sm120-fp4 demo``: SGLang's real NVFP4 linear and MoE layers, patched and verified on a simulated SM120 (CPU)."""

from __future__ import annotations

import functools
from typing import Callable

import torch

from ..sglang.layers import build_modelopt_layer
from .synthetic import make_checkpoint, make_moe_checkpoint, reference_moe_output, reference_output

_say = functools.partial(print, sep="\n", flush=True)  # each argument a line
_HEALTHY = {"backends": "cutlass,b12x,emulated", "moe_backends": "cutlass,emulated"}


def _selftest_table(decision) -> list[str]:
    """Return the self-test of `decision` as a table: a row per backend and shape, one per candidate skipped."""
    from ..tables import markdown_table

    def shown(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    rows = [
        (r.backend, s.m, s.n, s.k, s.passed, shown(s.rel_err, ".2e"), shown(s.norm_ratio, ".3f"), s.reason or "")
        for r in decision.reports
        for s in r.shapes
    ]
    tried = {r.backend for r in decision.reports}
    rows += [
        (name, "-", "-", "-", "skipped", "-", "-", why) for name, why in decision.rejected.items() if name not in tried
    ]
    header = ("backend", "M", "N", "K", "passed", "rel. error", "norm ratio", "reason")
    return ["  " + line for line in markdown_table(header, rows)]


def _quiet() -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore", module=r"sglang\..*")  # "Only CUDA ... support AWQ/GGUF" on a CPU
    logging.basicConfig(level=logging.WARNING, format="  log: %(message)s")
    for name in ("sglang", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _refuses(name: str, kernel: Callable, moe: bool, build: Callable, shown: str, lines: int | None = None) -> bool:
    """Install only the broken `kernel`, build a layer and show its refusal; return whether it was refused."""
    import sm120_fp4
    from sm120_fp4 import backends
    from sm120_fp4.errors import RefusedToServe

    sm120_fp4.uninstall()
    (backends.register_moe if moe else backends.register)(name, kernel, replace=True)
    chosen = {"backends": "emulated", "moe_backends": name} if moe else {"backends": name}
    sm120_fp4.install(simulate="12.0", **chosen)
    try:
        build()
    except RefusedToServe as exc:
        _say(shown, *("   | " + line for line in str(exc).splitlines()[:lines]))
        return True
    finally:
        sm120_fp4.uninstall()
        (backends.unregister_moe if moe else backends.unregister)(name)
    _say(f"   ERROR: the broken {'MoE ' if moe else ''}kernel was not refused")  # pragma: no cover
    return False  # pragma: no cover


def _dense_layer(n: int, k: int):
    """Steps 2-3: build the dense layer (its self-test runs), show the decision and what was patched."""
    import sm120_fp4
    from sm120_fp4 import serving

    _say(
        f"\n2. Build a real ModelOptFp4LinearMethod layer (N={n}, K={k}) from a synthetic NVFP4 checkpoint;",
        "   its process_weights_after_loading runs the self-test on this device before serving:",
    )
    ckpt = make_checkpoint(n, k, seed=7)
    method, layer = build_modelopt_layer(ckpt)
    decision = serving.decisions()[0]
    _say(
        f"   decision: {decision.backend} ({decision.reason}), verified={decision.verified}", *_selftest_table(decision)
    )
    for report in decision.layers:
        ms = ", ".join(str(s.m) for s in report.shapes)
        calls = sum(s.calls for s in report.shapes)
        _say(
            f"   then the layer itself: {report.config}, through SGLang's apply() at M = {ms}",
            f"   (two passes, {calls} calls): passed={report.passed}, max rel error {report.max_rel_err:.2e}",
        )
    _say("\n3. What was patched (the ledger; targets of other SGLang releases left out):")
    for p in sm120_fp4.status().patches:
        if p.state == "skipped" and (p.reason or "").startswith("not needed"):
            continue
        reason = f"  ({p.reason})" if p.reason else ""
        _say(f"   - {p.name:38s} {p.state:8s} {p.module.rsplit('.', 1)[-1]}.{p.attribute}{reason}")
    return ckpt, method, layer


def _dense_forward(ckpt, method, layer, m: int) -> None:
    """Step 4: SGLang's apply() against the nvfp4 reference and the unquantized layer."""
    _say(f"\n4. Forward pass through SGLang's apply() with M={m} tokens, compared with the nvfp4 reference:")
    x = (torch.randn(m, ckpt.dense.shape[1], generator=torch.Generator().manual_seed(1)) * 2).to(torch.bfloat16)
    out = method.apply(layer, x)
    dense = x.float() @ ckpt.dense.float().T
    diff = (out.float() - reference_output(ckpt, x).float()).abs().max().item()
    q_err = ((out.float() - dense).norm() / dense.norm()).item()
    _say(
        f"   output {tuple(out.shape)} {out.dtype}; max |SGLang - reference| = {diff:.3g} (bit-exact: {diff == 0})",
        f"   vs the unquantized bf16 layer: relative error {q_err:.3f} (the cost of 4-bit weights and activations)",
    )


def _zero_band(a, b, a_sf, b_sf, alpha, out_dtype, out):
    from sm120_fp4 import backends

    backends.emulated_mm_fp4(a, b, a_sf, b_sf, alpha, out_dtype, out)
    out[64:128] = 0
    return out


def main() -> int:
    """Run the README's walkthrough: SGLang's NVFP4 layers verified on a CPU, then broken kernels refused."""
    import sm120_fp4

    _quiet()
    _say(
        "sm120_fp4 demo: SGLang's NVFP4 linear layer on a SIMULATED SM120 GPU (CPU only)",
        "=" * 78,
        "On a real RTX PRO 6000 / RTX 5090 the same steps run FlashInfer's kernels; here no such GPU",
        "exists, so FlashInfer's backends are reported unsupported and the pure-PyTorch 'emulated'",
        "backend (checked against the nvfp4 oracle like any kernel) stands in for them.\n",
        "1. install(): patch SGLang (candidates cutlass, b12x, then emulated; MoE: cutlass, then emulated)",
    )
    status = sm120_fp4.install(simulate="12.0", **_HEALTHY)
    if not status.installed:
        _say(f"   not installed: {status.message}")
        return 2
    _say(f"   SGLang {status.sglang_version}; devices: {', '.join(status.devices)}")
    ckpt, method, layer = _dense_layer(256, 512)
    _dense_forward(ckpt, method, layer, 130)
    if _moe_part() is False:
        return 1
    _say("\n7. Now a broken dense kernel: it zeroes output rows 64-127 (as reported on SM12x), registered first:")
    shown = "   process_weights_after_loading raised RefusedToServe; a scheduler process exits non-zero with:\n"
    if not _refuses("zero-band", _zero_band, False, lambda: build_modelopt_layer(ckpt), shown):
        return 1
    _say("\nDone: the healthy paths served bit-exact results; the broken kernels never reached a request.")
    return 0


def _moe_layer():
    """Step 5: build SGLang's NVFP4 FusedMoE (its MoE self-test runs); None, saying why, where this SGLang cannot."""
    try:
        from ..sglang import moe_layers

        # Its scoped runtime seams (0.5.22+) come after the fused-MoE seam (0.5.15+): it says for both.
        problem = moe_layers.builder_problem()
        if problem is not None:
            raise ImportError(problem + "; `sm120-fp4 doctor` lists which MoE patches apply")
        ckpt = make_moe_checkpoint(8, 256, 128, seed=11)
        _say(
            "\n5. A real NVFP4 FusedMoE layer (ModelOptNvFp4FusedMoEMethod: 8 experts, H=256, I=128, top-2);",
            "   its process_weights_after_loading runs the MoE self-test, then checks the layer's own experts:",
        )
        return ckpt, moe_layers.build_modelopt_moe_layer(ckpt, top_k=2)
    except ImportError as exc:
        _say(f"\n5-6. NVFP4 MoE: skipped on this SGLang ({exc})")
        return None


def _drops_tile_rows(x, ids, w, *rest):
    """Zero rows 64-127 of each expert's 128-row tile (FlashInfer PR 3533 on SM120)."""
    from sm120_fp4 import backends

    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    rank = torch.empty_like(flat)
    counts = torch.bincount(flat, minlength=int(flat.max()) + 1)
    rank[order] = torch.arange(flat.numel()) - (torch.cumsum(counts, 0) - counts)[flat[order]]
    keep = ((rank % 128) < 64).reshape(ids.shape).to(w.dtype)
    return backends.emulated_moe(x, ids, w * keep, *rest)


def _moe_part() -> bool | None:
    """Steps 5-6: SGLang's NVFP4 FusedMoE verified, then a broken MoE kernel refused; None where skipped."""
    import sm120_fp4
    from sm120_fp4 import serving

    from ..sglang.moe_layers import build_modelopt_moe_layer, moe_forward

    built = _moe_layer()
    if built is None:
        return None
    ckpt, layer = built
    [decision] = [d for d in serving.decisions() if d.family == "moe"]
    candidates = ", ".join(f"{n}: {why}" for n, why in decision.rejected.items()) or "first passed"
    verdict = f"{decision.backend} ({decision.reason}), verified={decision.verified}"
    _say(f"   MoE decision: {verdict}; candidates: {candidates}")
    for report in decision.layers:
        _say(
            f"   the layer: {report.config}: {len(report.shapes)} batches (up to T={max(s.m for s in report.shapes)}, "
            f"one skewed) x 2 passes, passed={report.passed}"
        )
    gen = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(64)]).to(torch.int32)
    weights = torch.rand(64, 2, generator=gen)
    x = (torch.randn(64, 256, generator=gen) * 2).to(torch.bfloat16)
    out = moe_forward(layer, x, ids, weights)
    diff = (out.float() - reference_moe_output(ckpt, x, ids, weights).float()).abs().max().item()
    _say(
        f"   SGLang's MoE forward (64 tokens) vs reference_moe_fp4: max diff {diff:.3g} (bit-exact: {diff == 0})",
        "\n6. A broken MoE kernel: rows 64-127 of an expert's tile zeroed when it gets more than 64 rows",
        "   (FlashInfer PR 3533 on SM120), registered with register_moe:",
    )
    build = lambda: build_modelopt_moe_layer(ckpt, top_k=2)  # noqa: E731
    if not _refuses("tile-drop", _drops_tile_rows, True, build, "   refused:", 3):
        return False
    sm120_fp4.install(simulate="12.0", **_HEALTHY)
    return True

"""``sm120-fp4 demo``: SGLang's real NVFP4 linear layer, patched and verified on a simulated SM120 (CPU)."""

from __future__ import annotations

import torch

from ..sglang.layers import build_modelopt_layer
from .synthetic import make_checkpoint, make_moe_checkpoint, reference_moe_output, reference_output

__all__ = ["main"]


def _say(text: str = "") -> None:
    print(text, flush=True)


def _selftest_table(decision) -> list[str]:
    rows = [
        "  | backend | M | N | K | passed | rel. error | norm ratio | reason |",
        "  |---|---|---|---|---|---|---|---|",
    ]
    for report in decision.reports:
        for s in report.shapes:
            err = "-" if s.rel_err is None else f"{s.rel_err:.2e}"
            ratio = "-" if s.norm_ratio is None else f"{s.norm_ratio:.3f}"
            rows.append(
                f"  | {report.backend} | {s.m} | {s.n} | {s.k} | {s.passed} | {err} | {ratio} | {s.reason or ''} |"
            )
    for name, why in decision.rejected.items():
        if not any(r.backend == name for r in decision.reports):
            rows.append(f"  | {name} | - | - | - | skipped | - | - | {why} |")
    return rows


def main() -> int:
    """The README's main job: SGLang's real NVFP4 linear path, patched and verified, on a CPU."""
    import logging
    import warnings

    import sm120_fp4
    from sm120_fp4 import backends, serving
    from sm120_fp4.errors import RefusedToServe

    warnings.filterwarnings("ignore", module=r"sglang\..*")  # "Only CUDA ... support AWQ/GGUF" on a CPU
    logging.basicConfig(level=logging.WARNING, format="  log: %(message)s")
    for name in ("sglang", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    n, k, m = 256, 512, 130
    _say("sm120_fp4 demo: SGLang's NVFP4 linear layer on a SIMULATED SM120 GPU (CPU only)")
    _say("=" * 78)
    _say("On a real RTX PRO 6000 / RTX 5090 the same steps run FlashInfer's kernels; here no such GPU")
    _say("exists, so FlashInfer's backends are reported unsupported and the pure-PyTorch 'emulated'")
    _say("backend (checked against the nvfp4 oracle like any kernel) stands in for them.\n")

    _say("1. install(): patch SGLang (candidates cutlass, b12x, then emulated; MoE: cutlass, then emulated)")
    status = sm120_fp4.install(simulate="12.0", backends="cutlass,b12x,emulated", moe_backends="cutlass,emulated")
    if not status.installed:
        _say(f"   not installed: {status.message}")
        return 2
    _say(f"   SGLang {status.sglang_version}; devices: {', '.join(status.devices)}")

    _say(f"\n2. Build a real ModelOptFp4LinearMethod layer (N={n}, K={k}) from a synthetic NVFP4 checkpoint;")
    _say("   its process_weights_after_loading runs the self-test on this device before serving:")
    ckpt = make_checkpoint(n, k, seed=7)
    method, layer = build_modelopt_layer(ckpt)
    decision = serving.decisions()[0]
    _say(f"   decision: {decision.backend} ({decision.reason}), verified={decision.verified}")
    _say("\n".join(_selftest_table(decision)))
    for report in decision.layers:
        ms = [s.m for s in report.shapes]
        _say(f"   then the layer itself: {report.config}, through SGLang's apply() at M = {', '.join(map(str, ms))}")
        _say(
            f"   (two passes, {sum(s.calls for s in report.shapes)} calls): passed={report.passed}, max rel error {report.max_rel_err:.2e}"
        )

    _say("\n3. What was patched (the ledger; targets of other SGLang releases left out):")
    for p in sm120_fp4.status().patches:
        if p.state == "skipped" and (p.reason or "").startswith("not needed"):
            continue
        _say(
            f"   - {p.name:38s} {p.state:8s} {p.module.rsplit('.', 1)[-1]}.{p.attribute}"
            + (f"  ({p.reason})" if p.reason else "")
        )

    _say(f"\n4. Forward pass through SGLang's apply() with M={m} tokens, compared with the nvfp4 reference:")
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(1)) * 2).to(torch.bfloat16)
    out = method.apply(layer, x)
    want = reference_output(ckpt, x)
    dense = x.float() @ ckpt.dense.float().T
    diff = (out.float() - want.float()).abs().max().item()
    q_err = ((out.float() - dense).norm() / dense.norm()).item()
    _say(f"   output {tuple(out.shape)} {out.dtype}; max |SGLang - reference| = {diff:.3g} (bit-exact: {diff == 0})")
    _say(f"   vs the unquantized bf16 layer: relative error {q_err:.3f} (the cost of 4-bit weights and activations)")

    moe_ok = _moe_part()
    if moe_ok is False:
        return 1

    _say("\n7. Now a broken dense kernel: it zeroes output rows 64-127 (as reported on SM12x), registered first:")
    sm120_fp4.uninstall()

    def zero_band(a, b, a_sf, b_sf, alpha, out_dtype, out):
        backends.emulated_mm_fp4(a, b, a_sf, b_sf, alpha, out_dtype, out)
        out[64:128] = 0
        return out

    backends.register("zero-band", zero_band, replace=True)
    sm120_fp4.install(simulate="12.0", backends="zero-band")
    try:
        build_modelopt_layer(ckpt)
    except RefusedToServe as exc:
        _say("   process_weights_after_loading raised RefusedToServe; a scheduler process exits non-zero with:\n")
        _say("\n".join("   | " + line for line in str(exc).splitlines()))
    else:  # pragma: no cover - the demo must show the refusal
        _say("   ERROR: the broken kernel was not refused")
        return 1
    finally:
        sm120_fp4.uninstall()
        backends.unregister("zero-band")
    _say("\nDone: the healthy paths served bit-exact results; the broken kernels never reached a request.")
    return 0


def _moe_part() -> bool | None:
    """Steps 5-6: SGLang's real NVFP4 FusedMoE layer, verified; then a broken MoE kernel refused.
    None when this SGLang has no MoE modules to run (the step is skipped, saying why)."""
    import sm120_fp4
    from sm120_fp4 import backends, serving
    from sm120_fp4.errors import RefusedToServe

    try:
        from ..sglang import moe_layers
        from ..sglang.moe import SEAM_VERSIONS
        from ..versions import version_in

        if not version_in(sm120_fp4.status().sglang_version, SEAM_VERSIONS):
            raise ImportError(f"the fused-MoE seam exists in SGLang {SEAM_VERSIONS}")
        problem = moe_layers.builder_problem()
        if problem is not None:
            raise ImportError(problem + "; the MoE patches are applied, see `sm120-fp4 doctor`")
        ckpt = make_moe_checkpoint(8, 256, 128, seed=11)
        _say("\n5. A real NVFP4 FusedMoE layer (ModelOptNvFp4FusedMoEMethod: 8 experts, H=256, I=128, top-2);")
        _say("   its process_weights_after_loading runs the MoE self-test, then checks the layer's own experts:")
        layer = moe_layers.build_modelopt_moe_layer(ckpt, top_k=2)
    except ImportError as exc:
        _say(f"\n5-6. NVFP4 MoE: skipped on this SGLang ({exc})")
        return None
    [decision] = [d for d in serving.decisions() if d.family == "moe"]
    _say(
        f"   MoE decision: {decision.backend} ({decision.reason}), verified={decision.verified}; "
        f"candidates: {', '.join(f'{n}: {why}' for n, why in decision.rejected.items()) or 'first passed'}"
    )
    for report in decision.layers:
        _say(
            f"   the layer: {report.config}: {len(report.shapes)} batches (up to T={max(s.m for s in report.shapes)}, "
            f"one skewed) x 2 passes, passed={report.passed}"
        )
    gen = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(64)]).to(torch.int32)
    weights = torch.rand(64, 2, generator=gen)
    x = (torch.randn(64, 256, generator=gen) * 2).to(torch.bfloat16)
    out = moe_layers.moe_forward(layer, x, ids, weights)
    diff = (out.float() - reference_moe_output(ckpt, x, ids, weights).float()).abs().max().item()
    _say(f"   SGLang's MoE forward (64 tokens) vs reference_moe_fp4: max diff {diff:.3g} (bit-exact: {diff == 0})")

    _say("\n6. A broken MoE kernel: rows 64-127 of an expert's tile zeroed when it gets more than 64 rows")
    _say("   (FlashInfer PR 3533 on SM120), registered with register_moe:")

    def drops_tile_rows(x, ids, w, *rest):
        flat = ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        rank = torch.empty_like(flat)
        counts = torch.bincount(flat, minlength=int(flat.max()) + 1)
        rank[order] = torch.arange(flat.numel()) - (torch.cumsum(counts, 0) - counts)[flat[order]]
        keep = ((rank % 128) < 64).reshape(ids.shape).to(w.dtype)
        return backends.emulated_moe(x, ids, w * keep, *rest)

    sm120_fp4.uninstall()
    backends.register_moe("tile-drop", drops_tile_rows, replace=True)
    sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="tile-drop")
    try:
        moe_layers.build_modelopt_moe_layer(ckpt, top_k=2)
    except RefusedToServe as exc:
        _say("   refused:")
        _say("\n".join("   | " + line for line in str(exc).splitlines()[:3]))
    else:  # pragma: no cover - the demo must show the refusal
        _say("   ERROR: the broken MoE kernel was not refused")
        return False
    finally:
        sm120_fp4.uninstall()
        backends.unregister_moe("tile-drop")
    sm120_fp4.install(simulate="12.0", backends="cutlass,b12x,emulated", moe_backends="cutlass,emulated")
    return True

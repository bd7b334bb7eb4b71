"""``sm120-fp4 bench``'s layer configurations; each candidate verified at them, then timed."""

from __future__ import annotations

import sys
from typing import Callable

import torch

from .. import backends, deciding, verify
from ..devices import Device
from ..verify.moe import _moe_weights as moe_weights
from .timing import DenseShape, MoeShape, dense_bf16, dense_call, moe_bf16, moe_call, time_one

DECODE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PREFILL_SIZES = (512, 1024, 2048, 4096, 8192)
BF16 = "bf16"  # the yardstick's row name

# Without a checkpoint: one dense and one MoE layer of a common NVFP4 MoE model (a fused qkv_proj of
# 40 heads of 128 on a 2048 hidden size; 128 experts, top-8, hidden 2048, intermediate 768). On a
# simulated CPU device: small layers, since every kernel there is the pure-PyTorch emulation.
DEFAULT_DENSE, DEFAULT_MOE = ((5120, 2048),), ((128, 8, 2048, 768, True),)
CPU_DENSE, CPU_MOE = ((256, 512),), ((8, 2, 128, 64, True),)


def configurations(model: str | None, on_cpu: bool) -> tuple[list[DenseShape], list[MoeShape]]:
    """Return the distinct layer configurations to time: `model`'s (q/k/v, gate/up fused), else the defaults."""
    if model is None:
        dense, moe = (CPU_DENSE, CPU_MOE) if on_cpu else (DEFAULT_DENSE, DEFAULT_MOE)
        return [DenseShape(*c) for c in dense], [MoeShape(*c) for c in moe]
    from .. import checkpoints

    layers = checkpoints.discover(model)
    text = checkpoints.text_config(layers.config)
    top_k = int(text.get("num_experts_per_tok") or text.get("moe_topk") or 2)
    dense = dict.fromkeys(DenseShape(sum(d.sizes), d.k) for d in layers.dense)
    moe = dict.fromkeys(MoeShape(e.experts, top_k, e.hidden, e.inter, e.gated) for e in layers.moe)
    return list(dense), list(moe)


def _verify(family: str, name: str, config, sizes: list[int], device: Device, settings) -> str:
    """Return this backend's verdict on `device` at `config`: "verified", else why not."""
    # The sizes the self-test checks: the smallest, the largest decode size, the smallest prefill size.
    decode = [m for m in sizes if m <= DECODE_SIZES[-1]]
    prefill = [m for m in sizes if m > DECODE_SIZES[-1]]
    timeout, ms = settings.selftest_timeout, sorted({min(sizes), *(decode[-1:]), *(prefill[:1])})
    try:
        if family == "dense":
            shapes = [(m, config.n, config.k) for m in ms]
            quantizer = backends.quantizer_for(name, device)
            report = verify.run(name, device, shapes, bounds=verify.Bounds(timeout_s=timeout), quantizer=quantizer)
        else:
            layer = dict(experts=config.experts, hidden=config.hidden, intermediate=config.inter, top_k=config.top_k)
            layer.update(activation=config.activation, dtype="bfloat16")
            cases = tuple(verify.MoeCase(**layer, tokens=m, routing=r) for m in ms for r in ("balanced", "random"))
            bounds = verify.MOE_BOUNDS.model_copy(update={"timeout_s": timeout})
            report = verify.run_moe(name, device, verify.MoeConfig(cases=cases), bounds=bounds)
    except Exception as exc:
        return f"failed: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
    return "verified" if report.passed else f"failed: {(report.reason or 'did not pass').splitlines()[0]}"


def _verified(family: deciding.Family, names: list[str], config, sizes: list[int], device: Device, settings):
    """Return the rows of candidates not timed (unsupported, failed) and (name, make call, tune) for the rest."""
    tdev, base = device.torch_device, {"family": family.name, "config": config.label()}
    weights = None
    if family is deciding.MOE:
        weights = moe_weights(config.experts, config.hidden, config.inter, config.activation, tdev, 0)
    call, yardstick = (dense_call, dense_bf16) if family is deciding.DENSE else (moe_call, moe_bf16)
    rows, timed = [], []
    for name in names:
        ok, why = family.is_supported(name, device)
        if ok:
            eprint(f"[{device.label()}] verifying {family.name} backend {name!r} at {config.label()} ...")
        verdict = _verify(family.name, name, config, sizes, device, settings) if ok else f"unsupported: {why}"
        if verdict != "verified":
            rows.append({**base, "backend": name, "verdict": verdict, "m": None})
            continue
        fn, tune = family.resolve(name), backends.backend_of(family.name, name).kind == "flashinfer"
        timed.append((name, lambda m, fn=fn: call(fn, weights, config, m, tdev), tune))
    return rows, [*timed, (BF16, lambda m: yardstick(config, m, tdev), False)]


def _timed(device, base: dict, config, name: str, make: Callable, tune: bool, m: int) -> dict:
    """Return the row of one timed call of backend `name` at batch size `m`."""
    row = {**base, "backend": name}
    try:
        seconds, how = time_one(make(m), tune, device)
    except Exception as exc:
        return {**row, "verdict": f"failed while timed: {type(exc).__name__}: {exc}"[:200], "m": m}
    verdict = "yardstick" if name == BF16 else "verified"
    tflops = config.flops(m) / seconds / 1e12
    return {**row, "verdict": verdict, "m": m, "time_us": seconds * 1e6, "tflops": tflops, "timing": how}


def run(device: Device, settings, dense: list, moe: list, sizes: list[int], wanted=None) -> dict:
    """Verify, then time, each candidate of each family on `device`; return JSON-ready rows."""
    rows: list[dict] = []
    for family, configs in ((deciding.DENSE, dense), (deciding.MOE, moe)):
        names = (  # --backend's names of this family, else the configured candidates
            deciding.candidate_names(settings, family=family, device=device)
            if wanted is None
            else [n for n in wanted if n in family.names()]
        )
        for config in configs:
            untimed, timed = _verified(family, names, config, sizes, device, settings)
            rows += untimed
            base = {"family": family.name, "config": config.label()}
            for name, make, tune in timed:
                eprint(f"[{device.label()}] timing {family.name} {name} at {config.label()} ...")
                rows += [_timed(device.torch_device, base, config, name, make, tune, m) for m in sizes]
    # each time beside the yardstick's at the same configuration and size
    yardstick = {
        (r["family"], r["config"], r["m"]): r["time_us"] for r in rows if r["backend"] == BF16 and r.get("time_us")
    }
    for row in rows:
        if row.get("time_us") and row["backend"] != BF16:
            ref = yardstick.get((row["family"], row["config"], row["m"]))
            row["vs_bf16"] = ref / row["time_us"] if ref else None
    cap = "{}.{}".format(*device.capability)
    info = dict(index=device.index, name=device.name, capability=cap, simulated=device.simulated)
    versions = {"torch": torch.__version__, "flashinfer": backends.flashinfer_version()}
    configs = {"dense": [c.label() for c in dense], "moe": [c.label() for c in moe]}
    return {"device": info, "versions": versions, "sizes": sizes, **configs, "rows": rows}


def eprint(text: str) -> None:
    print(text, file=sys.stderr, flush=True)

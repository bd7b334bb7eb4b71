"""SELECT=fastest through vLLM's real NVFP4 linear layer (vLLM 0.32-0.33, a CPU, the device simulated as 12.0) with a
backend that converts each layer to its own layout (Humming's CPU stand-in) beside one that does not: each verified
and timed on its own prepared weights from the checkpoint's bytes, and a route split across them. Timings come from a
stand-in clock (helpers.fastest). Run with vLLM's venv: ``PYTHONPATH=$PWD .venv-vllm/bin/python -m pytest
tests/engine_vllm -q``; skipped where vLLM is not installed.
"""

from __future__ import annotations

import pytest
import torch
from helpers import vllm_layers

pytestmark = pytest.mark.skipif(vllm_layers.available() is not None, reason=str(vllm_layers.available()))

from helpers import fastest  # noqa: E402
from helpers.cases import case  # noqa: E402

import sm120_fp4  # noqa: E402
from sm120_fp4 import serving  # noqa: E402
from sm120_fp4.demo import synthetic  # noqa: E402

BOUND = 64  # the largest CUDA-graph batch of these tests' vLLM config
TOKENS = 256  # its prefill chunk


@pytest.fixture(scope="module", autouse=True)
def _vllm_imported():
    sm120_fp4.install(simulate="12.0", backends="emulated")
    try:
        vllm_layers.import_modules()
    finally:
        sm120_fp4.uninstall()


@pytest.fixture(autouse=True)
def _uninstalled():
    yield
    if sm120_fp4.status().installed:
        sm120_fp4.uninstall()


@case(
    "configuration",
    "SELECT=fastest in vLLM with humming (converts each layer) and a registered non-converting kernel: {costs}",
    "{route} serves, verified; neither candidate refused; the layer serves the oracle's numbers at every M",
)
@pytest.mark.parametrize(
    "costs, humming_cost, other_cost, route",
    [
        ("humming faster at every M (chosen first)", lambda m: 1.0, lambda m: 5.0, [(None, "humming")]),
        (
            "humming faster at decode sizes, the other at prefill sizes",
            lambda m: 1.0 if m <= BOUND else 10.0,
            lambda m: 2.0 if m <= BOUND else 5.0,
            [(BOUND, "humming"), (None, "other")],
        ),
    ],
)
def test_fastest_with_a_converting_candidate_in_vllm(monkeypatch, costs, humming_cost, other_cost, route):
    clock, calls = fastest.use_clock(monkeypatch), []
    fastest.kernel("other", clock, calls, other_cost)
    ckpt = synthetic.make_checkpoint(256, 512, seed=7)  # Humming's alignment: it could convert in vLLM's storage
    with fastest.timed_humming(clock, monkeypatch, humming_cost):
        sm120_fp4.install(simulate="12.0", backends="humming,other", select="fastest")
        with vllm_layers.vllm_context(max_tokens=TOKENS, max_batch=BOUND):
            layer = vllm_layers.build_modelopt_layer(ckpt)
            [decision] = serving.decisions()
            assert serving.STATE.records[("dense", -1)].failed == {}
            assert (decision.ranges or [(None, decision.backend)]) == route and decision.verified
            assert decision.layers and all(r.passed for r in decision.layers)
            if len(route) > 1:
                assert {BOUND, BOUND + 1} <= {s.m for s in decision.layers[0].shapes}
            for m in (1, BOUND, BOUND + 1, TOKENS):
                x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
                assert torch.equal(layer(x)[0], synthetic.reference_output(ckpt, x))

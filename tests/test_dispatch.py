"""The dispatch function that replaces FlashInfer's alias: what it routes, what it passes through."""

from __future__ import annotations

import pytest
import torch
from helpers import faults
from helpers.common import mm_fp4_operands

from sm120_fp4 import backends, devices, nvfp4
from sm120_fp4.config import Settings
from sm120_fp4.devices import Device
from sm120_fp4.dispatch import Router
from sm120_fp4.errors import RefusedToServe


class Original:
    """Stands in for flashinfer.mm_fp4 on a CPU: records how it was called."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return "original"


def operands(m=5, n=32, k=64):
    return mm_fp4_operands(m, n, k)


def ready(settings, original, recording=None):
    """A dispatch whose decision (and self-test calls) already happened."""
    router = Router(settings)
    router.ensure(-1)
    if recording is not None:
        recording.clear()
    return router.make_dispatch(original)


@pytest.fixture
def recording():
    seen = []

    def gemm(a, b, a_sf, b_sf, alpha, dtype, out):
        seen.append((alpha, out))
        return faults.healthy(a, b, a_sf, b_sf, alpha, dtype, out)

    backends.register("recording", gemm)
    return seen


@pytest.mark.parametrize("backend", ["auto", "cudnn", "cutlass"])
def test_routed_backends_go_to_the_decided_backend_with_alpha_and_out(recording, backend):
    original = Original()
    dispatch = ready(Settings(simulate="12.0", backends="recording"), original, recording)
    args = operands()
    result = dispatch(*args, torch.bfloat16, backend=backend)
    assert original.calls == [] and len(recording) == 1
    alpha, out = recording[0]
    assert alpha is args[4] and out is result and out.is_contiguous()
    assert torch.equal(result, nvfp4.reference_mm_fp4(*args))


def test_no_backend_argument_is_routed_too(recording):
    dispatch = ready(Settings(simulate="12.1", backends="recording"), Original(), recording)
    dispatch(*operands(), torch.bfloat16)
    assert len(recording) == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"enable_pdl": False},
        {"enable_pdl": True},
        {"use_nvfp4": True},
        {"batch_invariant": False},
        {"enable_pdl": True, "batch_invariant": False},
    ],
)
def test_keywords_that_never_change_the_numbers_are_routed(recording, kwargs):
    original = Original()
    dispatch = ready(Settings(simulate="12.0", backends="recording"), original, recording)
    args = operands()
    result = dispatch(*args, torch.bfloat16, backend="cutlass", **kwargs)
    assert original.calls == [] and len(recording) == 1
    assert torch.equal(result, nvfp4.reference_mm_fp4(*args))


@pytest.mark.parametrize(
    "kwargs", [{"backend": "trtllm"}, {"backend": "cute-dsl"}, {"use_8x4_sf_layout": True}, {"block_size": 32}]
)
def test_other_backends_and_layouts_call_the_original_unchanged(recording, kwargs):
    original = Original()
    dispatch = ready(Settings(simulate="12.0", backends="recording"), original, recording)
    args = operands()
    assert dispatch(*args, torch.bfloat16, **kwargs) == "original"
    ((called_args, called_kwargs),) = original.calls
    assert called_args[:4] == args[:4] and called_kwargs.items() >= kwargs.items()
    assert recording == []


def test_a_device_that_is_not_12x_calls_the_original():
    original = Original()
    dispatch = Router(Settings(simulate="9.0", backends="emulated")).make_dispatch(original)
    assert dispatch(*operands(), torch.bfloat16, backend="auto") == "original"
    assert len(original.calls) == 1


def test_enable_on_routes_any_gpu(recording):
    dispatch = ready(Settings(simulate="9.0", enable="on", backends="recording"), Original(), recording)
    dispatch(*operands(), torch.bfloat16)
    assert len(recording) == 1


def test_cpu_tensors_outside_simulation_call_the_original():
    original = Original()
    with devices.use_probe(lambda: [Device(0, "RTX PRO 6000", (12, 0))]):
        dispatch = Router(Settings(backends="emulated")).make_dispatch(original)
        assert dispatch(*operands(), torch.bfloat16) == "original"


def test_missing_alpha_becomes_one_without_a_new_tensor_each_call(recording):
    dispatch = ready(Settings(simulate="12.0", backends="recording"), Original(), recording)
    args = operands()[:4]
    dispatch(*args, None, torch.bfloat16)
    dispatch(*args, None, torch.bfloat16)
    (a1, _), (a2, _) = recording
    assert a1 is a2 and a1.dtype == torch.float32 and a1.tolist() == [1.0]


def test_non_contiguous_out_is_filled_through_a_contiguous_buffer(recording):
    dispatch = ready(Settings(simulate="12.0", backends="recording"), Original(), recording)
    args = operands(m=4, n=32)
    out = torch.full((32, 4), float("nan"), dtype=torch.bfloat16).T
    ret = dispatch(*args, torch.bfloat16, out)
    assert ret is out and recording[0][1] is not out and recording[0][1].is_contiguous()
    assert torch.equal(out, nvfp4.reference_mm_fp4(*args))


def test_first_call_self_tests_once_and_a_failing_kernel_raises_not_zeros():
    backends.register("zeros", faults.returns_zeros)
    dispatch = Router(Settings(simulate="12.0", backends="zeros")).make_dispatch(Original())
    with pytest.raises(RefusedToServe, match="zeros: self-test failed: .*all zeros"):
        dispatch(*operands(), torch.bfloat16)


# ---- through the patched alias's front (Router.make_dispatch) -----------------------------------

from helpers.cases import case  # noqa: E402

from sm120_fp4.errors import InvalidArgument  # noqa: E402


@case(
    "own failures",
    "an empty batch (M=0) through the patched alias, out={out}",
    "an empty (0, N) result as torch.mm gives; the backend is not called",
)
@pytest.mark.parametrize("out", ["None", "a (0, N) tensor"])
def test_an_empty_batch_gives_an_empty_result(recording, out):
    dispatch = ready(Settings(simulate="12.0", backends="recording"), Original(), recording)
    a, b, a_sf, b_sf, alpha = operands()
    empty_a = a[:0]
    given = torch.empty(0, b.shape[1], dtype=torch.bfloat16) if out != "None" else None
    result = dispatch(empty_a, b, a_sf, b_sf, alpha, torch.bfloat16, given)
    assert tuple(result.shape) == (0, b.shape[1]) and result.dtype == torch.bfloat16
    assert given is None or result is given
    assert recording == []


@case(
    "own failures",
    "our own dispatch given {what}",
    "InvalidArgument naming {param} (not an IndexError/TypeError blamed on the backend)",
)
@pytest.mark.parametrize("what, param", [("a 1-D b", "b"), ("out_dtype='bf16' (a string)", "out_dtype")])
def test_bad_arguments_through_the_alias_name_the_parameter(recording, what, param):
    dispatch = ready(Settings(simulate="12.0", backends="recording"), Original(), recording)
    a, b, a_sf, b_sf, alpha = operands()
    args = [
        a,
        b.reshape(-1) if param == "b" else b,
        a_sf,
        b_sf,
        alpha,
        "bf16" if param == "out_dtype" else torch.bfloat16,
    ]
    with pytest.raises(InvalidArgument, match=rf"mm_fp4: {param}=") as err:
        dispatch(*args)
    assert "raised by FP4 GEMM backend" not in "".join(getattr(err.value, "__notes__", []))

"""SGLang's FlashInfer autotune gate (0.5.15+), widened to the NVFP4 layers this library serves.

SGLang tunes only for a FlashInfer MoE runner string or a ModelOpt quantization; where that alone says no, the gate
is asked again with the runner read as ``flashinfer_cutlass`` and says yes for a served backend FlashInfer tunes.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from typing import Callable, Iterator

from ..versions import version_in
from .release import RUNTIME_CONTEXT, sglang_version

_LOG = logging.getLogger("sm120_fp4")
RUNNER = "flashinfer_cutlass"  # the explicit configuration whose tuning the served layers get
# The routed backends whose FlashInfer kernels consult its autotuner (mm_fp4's cutlass, b12x; cutlass_fused_moe).
TUNABLE = {"dense": frozenset({"cutlass", "b12x"}), "moe": frozenset({"cutlass"})}


def tunable_backends(routes: dict[str, dict[int, str]], index: int) -> list[str]:
    """Return the families `routes` (serving.routes by family) serves on device `index` tunably: 'family:backend'."""
    return [f"{f}:{routes[f][index]}" for f in ("dense", "moe") if routes.get(f, {}).get(index) in TUNABLE[f]]


def _reads_server_args() -> bool:
    """Return whether the gate reads the model runner's ServerArgs (0.5.15-0.5.17), not the runtime context."""
    return not version_in(sglang_version() or "0", ">=0.5.18")


def _configured_runner(model_runner, for_speculative_draft: bool) -> str | None:
    """Return the MoE runner string SGLang's gate reads (the draft's own one first, for the draft)."""
    if _reads_server_args():
        args = model_runner.server_args
        own = getattr(args, "speculative_moe_runner_backend", None) if for_speculative_draft else None
        return own or args.moe_runner_backend
    context = sys.modules[RUNTIME_CONTEXT]
    target = context.get_exec().moe.moe_runner_backend
    own = context.get_spec().speculative_moe_runner_backend if for_speculative_draft else None
    return own or target


@contextlib.contextmanager
def _as_explicit_runner(model_runner, for_speculative_draft: bool) -> Iterator[None]:
    """Make SGLang's configured MoE runner string(s) read as `RUNNER` in this scope (one gate call at warm-up)."""
    with contextlib.ExitStack() as stack:
        if _reads_server_args():
            args = model_runner.server_args
            names = ["moe_runner_backend"]
            if for_speculative_draft and getattr(args, "speculative_moe_runner_backend", None):
                names.append("speculative_moe_runner_backend")
            for name in names:
                stack.callback(setattr, args, name, getattr(args, name))
                setattr(args, name, RUNNER)
        else:
            context = sys.modules[RUNTIME_CONTEXT]
            stack.enter_context(context.get_exec().moe.override(moe_runner_backend=RUNNER))
            spec = context.get_spec()
            if for_speculative_draft and spec.speculative_moe_runner_backend:
                stack.enter_context(spec.override(speculative_moe_runner_backend=RUNNER))
        yield


def make_gate(original: Callable, served: Callable[[], list[str]], said: set[str] | None = None) -> Callable:
    """Replace SGLang's ``should_run_flashinfer_autotune``; `served()` names the tunable families served here."""
    # Never raises into SGLang's warm-up (its answer stands); `said` is shared by both names of the gate.
    said = set() if said is None else said

    @functools.wraps(original)
    def should_run_flashinfer_autotune(model_runner, *, for_speculative_draft: bool = False):
        answer = original(model_runner, for_speculative_draft=for_speculative_draft)
        if answer:
            return answer
        try:
            runner = _configured_runner(model_runner, for_speculative_draft)
            if isinstance(runner, str) and runner.startswith("flashinfer_"):
                return answer  # SGLang read a FlashInfer runner: its no is for another reason
            families = served()
            if not families:
                return answer
            with _as_explicit_runner(model_runner, for_speculative_draft):
                if not original(model_runner, for_speculative_draft=for_speculative_draft):
                    return answer  # one of SGLang's other refusals
        except Exception as exc:
            if "error" not in said:
                said.add("error")
                _LOG.warning(
                    "sm120_fp4: cannot tell whether SGLang's FlashInfer autotune applies to the NVFP4 layers "
                    "served here (%s: %s); SGLang's own answer (no) stands: those layers run FlashInfer's "
                    "untuned tactics",
                    type(exc).__name__,
                    exc,
                )
            return answer
        key = f"{for_speculative_draft}:{','.join(families)}"
        if key not in said:
            said.add(key)
            _LOG.info(
                "sm120_fp4: SGLang's FlashInfer autotune runs for the NVFP4 layers served here (%s%s), as it "
                "would for an explicit --moe-runner-backend %s configuration (its cache and TP synchronisation; "
                "--disable-flashinfer-autotune turns it off)",
                ", ".join(families),
                "; speculative draft" if for_speculative_draft else "",
                RUNNER,
            )
        return True

    return should_run_flashinfer_autotune

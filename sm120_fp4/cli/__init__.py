"""``sm120-fp4 doctor | selftest | launch | demo | patches | bench`` (also ``python -m sm120_fp4``).

Exit codes (docs/operations.md):
  0  verified: every GPU this library serves has a verified backend (or there is none to serve)
  1  refused: no candidate verified on some GPU (a kernel failed, or crashed its process), or
     doctor --strict found a problem
  2  bad usage or environment: an invalid setting or argument, no such device, a worker that died
     outside any candidate; under SM120_FP4_SELFTEST=strict, an SGLang release outside the supported
     range (unless SM120_FP4_UNSUPPORTED_RELEASE=serve-unverified)
  3  unverified: a decision would serve without verification (SM120_FP4_SELFTEST=warn or off), or
     the SGLang release is outside the supported range and not refused; `launch` does not start the
     command on it unless given --allow-unverified (or, for the release, the opt-out setting)
  128+N  interrupted by signal N (130: SIGINT, 143: SIGTERM): the workers were stopped and nothing
     was recorded for the candidates they were running

:mod:`.commands` parses and dispatches; :mod:`.selftest` is the preflight parent, :mod:`.workers`
its short-lived worker processes, :mod:`.launch` the preflight then exec.
"""

from .commands import _parser, main
from .common import EXIT_OK, EXIT_REFUSED, EXIT_UNVERIFIED, EXIT_USAGE
from .launch import COREDUMP_WAIT_VAR
from .selftest import use_model_worker_runner, use_worker_runner
from .workers import WorkerOutput, _model_worker, _worker, model_worker_argv, worker_argv

__all__ = [
    "main",
    "EXIT_OK",
    "EXIT_REFUSED",
    "EXIT_USAGE",
    "EXIT_UNVERIFIED",
    "use_worker_runner",
    "worker_argv",
    "WorkerOutput",
    "use_model_worker_runner",
    "model_worker_argv",
    "COREDUMP_WAIT_VAR",
    "_parser",
    "_worker",
    "_model_worker",
]

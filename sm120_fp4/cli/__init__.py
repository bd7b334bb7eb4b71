"""``sm120-fp4 doctor | selftest | launch | demo | bench`` (also ``python -m sm120_fp4``).

Exit codes (docs/operations.md): 0 verified (or nothing to serve); 1 refused (or doctor --strict found a problem);
2 bad usage or environment; 3 unverified (``launch`` starts nothing on it without --allow-unverified); 128+N
interrupted by signal N, nothing recorded for the running candidates."""

from .commands import _parser, main
from .common import EXIT_OK, EXIT_REFUSED, EXIT_UNVERIFIED, EXIT_USAGE
from .launch import COREDUMP_WAIT_VAR
from .selftest import use_worker_runner
from .workers import WorkerOutput, _model_worker, _worker, model_worker_argv, worker_argv

__all__ = ["main", "EXIT_OK", "EXIT_REFUSED", "EXIT_USAGE", "EXIT_UNVERIFIED", "use_worker_runner", "worker_argv"]
__all__ += ["WorkerOutput", "model_worker_argv", "COREDUMP_WAIT_VAR", "_parser", "_worker"]
__all__ += ["_model_worker"]

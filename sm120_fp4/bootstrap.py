"""Start-up activation for every new interpreter (spawned SGLang schedulers included).

The ``sm120_fp4.pth`` file installed into site-packages runs one line at interpreter start-up:
when ``SM120_FP4`` is ``1``/``on`` it calls :func:`activate`, otherwise it does nothing (no import
of this package, of torch or of pydantic). :func:`activate` only registers a post-import hook on
``sglang``; ``install()`` runs when SGLang is imported, so plain Python processes pay almost
nothing. Nothing here raises at start-up except an invalid setting, which must stop a worker
loudly rather than let it serve unverified.
"""

from __future__ import annotations

import os
import sys

_ON = ("1", "on")
_activated = False


def enabled(environ=os.environ) -> bool:
    return environ.get("SM120_FP4") in _ON


def _on_sglang(module) -> None:
    from .errors import ConfigError

    try:
        from . import api

        api.install()
    except ConfigError:
        raise  # the operator asked for the library with a bad setting: stop, naming it
    except Exception as exc:  # noqa: BLE001 - our own failure must not break SGLang
        sys.stderr.write(f"sm120_fp4: activation failed, SGLang runs unpatched: {type(exc).__name__}: {exc}\n")


def activate() -> None:
    """Arrange for install() when SGLang is imported (idempotent; never raises)."""
    global _activated
    if _activated:
        return
    try:
        import wrapt

        wrapt.register_post_import_hook(_on_sglang, "sglang")
        _activated = True
    except Exception as exc:  # noqa: BLE001
        sys.stderr.write(f"sm120_fp4: start-up bootstrap failed, SGLang runs unpatched: {exc!r}\n")

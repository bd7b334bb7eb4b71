"""vLLM's plugin allow-list (``VLLM_PLUGINS``): set without this library's plugin, nothing of it runs in vLLM."""

from __future__ import annotations

import os

from . import release

VARIABLE = "VLLM_PLUGINS"
PLUGIN = "sm120_fp4"  # the entry point's name in vllm.general_plugins (pyproject.toml)


def plugin_problem() -> str | None:
    """Return why vLLM would not load this library's plugin here (``VLLM_PLUGINS`` leaves it out), or None."""
    if VARIABLE not in os.environ or release.RELEASE.version() is None:
        return None
    # vLLM's own reading (vllm/envs.py, plugins/__init__.py): set, the value split at commas, each name compared
    # as it is (no spaces stripped), and only the plugins named are loaded -- none for an empty value.
    allowed = os.environ[VARIABLE].split(",")
    if PLUGIN in allowed:
        return None
    others = ",".join(name.strip() for name in allowed if name.strip() and name.strip() != PLUGIN)
    fix = f"{VARIABLE}={others},{PLUGIN}" if others else f"{VARIABLE}={PLUGIN}"
    spaced = next(
        (f" (names are compared as written: {n!r} is not {PLUGIN!r})" for n in allowed if n.strip() == PLUGIN), ""
    )
    return (
        f"{VARIABLE}={os.environ[VARIABLE]!r} does not name {PLUGIN}{spaced}: vLLM loads only the plugins it names, so "
        f"nothing of sm120_fp4 runs in that server and no NVFP4 layer is verified; set {fix}, or unset {VARIABLE}"
    )

"""SGLang plugin entry point (group ``sglang.srt.plugins``), loaded by SGLang 0.5.11+ in every
scheduler process. Activates only when the ``SM120_FP4`` toggle is on, like the ``.pth`` bootstrap."""

from __future__ import annotations


def load() -> None:
    """Install the patches in this process when the SM120_FP4 toggle is on."""
    from ..bootstrap import enabled

    if enabled():
        from .. import api

        if not api.installed():  # the .pth bootstrap or the user's own install() may have run first
            api.install()

"""Everything this library knows about SGLang, in one package (ARCHITECTURE.md maps its modules).

Importing it imports nothing heavy (the start-up hook reads :mod:`.names`); :data:`ENGINE`'s members load their
modules on first use."""

from __future__ import annotations

from ..engines import Engine

__all__ = ["ENGINE", "SGLang"]


class SGLang(Engine):
    """The SGLang engine home: a carried patches/ diff, and an idle point for the canary in its scheduler loop."""

    name, package = "sglang", __name__

    def carried_fix(self) -> str | None:
        return self.module("release").carried_fix()

    def idle_point_problem(self, settings) -> str | None:
        return self.wiring().idle_point_problem(settings)


ENGINE = SGLang()

"""Everything this library knows about SGLang, in one package (ARCHITECTURE.md maps its modules).

Importing it imports nothing heavy (the start-up hook reads :mod:`.names`); :data:`ENGINE`'s members load their
modules on first use."""

from __future__ import annotations

from ..engines import Engine

__all__ = ["ENGINE", "SGLang"]


class SGLang(Engine):
    """The SGLang engine home."""

    name = "sglang"

    def wiring(self):
        from . import wiring

        return wiring

    @property
    def release(self):
        from .release import RELEASE

        return RELEASE

    def carried_fix(self) -> str | None:
        from .release import carried_fix

        return carried_fix()

    def idle_point_problem(self, settings) -> str | None:
        return self.wiring().idle_point_problem(settings)

    def doctor_rows(self) -> dict:
        from .targets import doctor_rows

        return doctor_rows()

    def rank(self) -> dict[str, int]:
        from .release import rank

        return rank()

    def cpu_tp_env(self, command: list[str]) -> dict[str, str]:
        from .simulation import cpu_tp_env

        return cpu_tp_env(command)


ENGINE = SGLang()

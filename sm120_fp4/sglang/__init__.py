"""Everything this library knows about SGLang, in one package (ARCHITECTURE.md maps its modules).

Importing it imports nothing else (the start-up hook reads :mod:`.names`); :data:`ENGINE` loads each module on first
use."""

from __future__ import annotations

__all__ = ["ENGINE", "SGLang"]


class SGLang:
    """The SGLang engine home (:class:`sm120_fp4.engines.Engine`)."""

    name = "sglang"

    @property
    def release(self):
        from .release import RELEASE

        return RELEASE

    def attach(self, patcher, router, settings, canary) -> list:
        from .wiring import attach

        return attach(patcher, router, settings, canary)

    def carried_fix(self) -> str | None:
        from .release import carried_fix

        return carried_fix()

    def idle_point_problem(self, settings) -> str | None:
        from .wiring import idle_point_problem

        return idle_point_problem(settings)

    canary_problem = idle_point_problem  # SGLang's canary runs wherever it is installed and its idle point exists

    def doctor_rows(self) -> dict:
        from .targets import doctor_rows

        return doctor_rows()

    def launches(self, command: list[str]) -> bool:
        from ..engines import starts

        return starts(command, self.name)

    def ranks(self) -> dict:
        return {}


ENGINE = SGLang()

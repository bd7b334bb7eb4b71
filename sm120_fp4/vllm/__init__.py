"""Everything this library knows about vLLM (the second engine home); importing it imports nothing else."""

from __future__ import annotations

__all__ = ["ENGINE", "VLLM"]


class VLLM:
    """The vLLM engine home (:class:`sm120_fp4.engines.Engine`)."""

    name = "vllm"

    @property
    def release(self):
        from .release import RELEASE

        return RELEASE

    def attach(self, patcher, router, settings, canary) -> list:
        from .wiring import attach

        return attach(patcher, router, settings, canary)

    def carried_fix(self) -> str | None:
        """vLLM carries no patches/ diff of this library."""
        return None

    def idle_point_problem(self, settings) -> str | None:
        """None: the canary is refused where vLLM serves (:meth:`canary_problem`), not merely if installed."""
        return None

    def canary_problem(self, settings) -> str | None:
        from .wiring import canary_problem

        return canary_problem(settings)

    def doctor_rows(self) -> dict:
        from .targets import doctor_rows

        return doctor_rows()

    def launches(self, command: list[str]) -> bool:
        from ..engines import starts

        return starts(command, self.name)

    def ranks(self) -> dict:
        return {}


ENGINE = VLLM()

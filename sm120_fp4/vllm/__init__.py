"""Everything this library knows about vLLM (the second engine home); importing it imports nothing heavy."""

from __future__ import annotations

from ..engines import Engine

__all__ = ["ENGINE", "VLLM"]


class VLLM(Engine):
    """The vLLM engine home: no patches/ diff; the canary is refused where vLLM serves, not merely if installed."""

    name = "vllm"

    @property
    def release(self):
        from .release import RELEASE

        return RELEASE

    def canary_problem(self, settings) -> str | None:
        return self.wiring().canary_problem(settings)

    def wiring(self):
        from . import wiring

        return wiring

    def doctor_rows(self) -> dict:
        from .targets import doctor_rows

        return doctor_rows()

    def rank(self) -> dict[str, int]:
        from .release import rank

        return rank()

    def cpu_tp_env(self, command: list[str]) -> dict[str, str]:
        from .simulation import cpu_tp_env

        return cpu_tp_env(command)


ENGINE = VLLM()

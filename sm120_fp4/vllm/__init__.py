"""Everything this library knows about vLLM (the second engine home); importing it imports nothing heavy."""

from __future__ import annotations

from ..engines import Engine

__all__ = ["ENGINE", "VLLM"]


class VLLM(Engine):
    """The vLLM engine home: no patches/ diff; the canary is refused where vLLM serves, not merely if installed."""

    name, package = "vllm", __name__

    def canary_problem(self, settings) -> str | None:
        return self.wiring().canary_problem(settings)


ENGINE = VLLM()

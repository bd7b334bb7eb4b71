"""Humming as the fallback chain's last verified link: :mod:`.engine` (Humming), :mod:`.convert` (layers converted
at load), :mod:`.adapter` (backends, status), :mod:`.cuda` (activation dequantization)."""

from .adapter import *  # noqa: F403
from .adapter import __all__  # noqa: F401

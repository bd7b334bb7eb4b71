"""The SM120_FP4 toggle: its values and how they are read (stdlib only, below bootstrap and config)."""

from __future__ import annotations

import os

TOGGLE_VAR = "SM120_FP4"
# The one definition of the toggle's values; the .pth line repeats TOGGLE_OFF as a literal (no import).
TOGGLE_ON = ("1", "on")
TOGGLE_OFF = ("", "0", "off")


def parse_toggle(value: object) -> bool | None:
    """Return True for 1/on, False for 0/off, None for unset; ValueError otherwise (an empty string too)."""
    if value is None or isinstance(value, bool):
        return value
    if type(value) is int and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value and (value in TOGGLE_ON or value in TOGGLE_OFF):
        return value in TOGGLE_ON
    raise ValueError("accepted: 1, on, 0, off (or unset)")


def enabled(environ=os.environ) -> bool:
    """Return True when SM120_FP4 is anything but 0/off/empty (garbage reaches install(), which rejects it)."""
    return environ.get(TOGGLE_VAR, "") not in TOGGLE_OFF

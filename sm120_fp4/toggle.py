"""The SM120_FP4 toggle: its values and how they are read. Stdlib only, imports nothing of ours:
the start-up hook (bootstrap) and the settings (config) both read it, so it sits below both."""

from __future__ import annotations

import os

TOGGLE_VAR = "SM120_FP4"
# The one definition of the toggle's values (config.Settings parses with it too). The .pth line
# repeats TOGGLE_OFF as a literal: importing anything there would cost every interpreter start-up.
TOGGLE_ON = ("1", "on")
TOGGLE_OFF = ("", "0", "off")


def parse_toggle(value: object) -> bool | None:
    """True for 1/on (or the int 1), False for 0/off (or 0), None for unset; ValueError otherwise.

    An empty string is rejected here although the start-up line treats it as off: a variable set
    to nothing is a mistake worth naming when the settings are read."""
    if value is None or isinstance(value, bool):
        return value
    if type(value) is int and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value and (value in TOGGLE_ON or value in TOGGLE_OFF):
        return value in TOGGLE_ON
    raise ValueError("accepted: 1, on, 0, off (or unset)")


def enabled(environ=os.environ) -> bool:
    """True when SM120_FP4 is set to anything but 0/off/empty: a garbage value must reach
    install(), which rejects it loudly, rather than leave a worker silently unpatched."""
    return environ.get(TOGGLE_VAR, "") not in TOGGLE_OFF

"""Verification against the nvfp4 oracle: one backend (or one served call) on one device.

:mod:`.engine` bounds, judges and sweeps cases; :mod:`.watchdog` makes each call on the serving
thread and only observes it; :mod:`.data` makes the check data; :mod:`.fingerprint` the weights'
fingerprints; :mod:`.dense` and :mod:`.moe` the self-tests of the two families.
"""

from . import data as _data
from . import dense as _dense
from . import engine as _engine
from . import fingerprint as _fingerprint
from . import moe as _moe
from . import watchdog as _watchdog
from .data import *  # noqa: F403
from .dense import *  # noqa: F403
from .engine import *  # noqa: F403
from .fingerprint import *  # noqa: F403
from .moe import *  # noqa: F403
from .watchdog import *  # noqa: F403

__all__ = [*_data.__all__, *_dense.__all__, *_engine.__all__, *_fingerprint.__all__, *_moe.__all__, *_watchdog.__all__]

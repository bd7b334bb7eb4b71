"""Settings: keyword arguments > ``SM120_FP4_*`` environment variables > defaults.

Every value is checked when the settings are built (``install()`` or CLI start): a bad one raises
:class:`~sm120_fp4.errors.ConfigError` naming the variable, the value and what is accepted.
"""

from .flashinfer import check_flashinfer_env, flashinfer_overrides, flashinfer_problem
from .settings import Settings, env_name, load_settings, settings_table, sources
from .values import AUTO

__all__ = [
    "Settings",
    "load_settings",
    "env_name",
    "AUTO",
    "flashinfer_overrides",
    "flashinfer_problem",
    "check_flashinfer_env",
    "settings_table",
    "sources",
]

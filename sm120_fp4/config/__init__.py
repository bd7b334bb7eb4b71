"""Settings: keyword arguments > ``SM120_FP4_*`` environment variables > defaults; every value is checked when
the settings are built (``install()`` or CLI start): a ConfigError names the variable, the value and what is accepted.
"""

from .flashinfer import check_flashinfer_env, flashinfer_overrides, flashinfer_problem  # noqa: F401
from .settings import Settings, env_name, load_settings, sources  # noqa: F401
from .values import AUTO  # noqa: F401

"""``python -m sm120_fp4``: the same as the ``sm120-fp4`` console script."""

import sys

from .cli import main

sys.exit(main())

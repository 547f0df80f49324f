"""Benchmark settings: the project's settings plus the ``bench`` app (its no-op kind).

``bench/run.py`` points ``DATABASE_URL`` at a scratch database and ``HOLDFAST_VAR_DIR`` at
a temporary directory before any process loads this module.
"""

from config.settings import *  # noqa: F403
from config.settings import INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "bench"]

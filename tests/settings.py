"""Test settings: the project's settings plus a test app with its own job kinds and tables."""

import json
import os

from config.settings import *  # noqa: F403
from config.settings import INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "tests.testapp"]

# Process tests declare schedules for their scheduler subprocesses through the environment.
HOLDFAST_SCHEDULES = json.loads(os.environ.get("HOLDFAST_TEST_SCHEDULES", "{}"))

# Django's live test server (pytest-django's live_server) wraps the app in a static-files
# handler that needs a STATIC_URL, though Holdfast serves no static files.
STATIC_URL = "/static/"

# Django tasks (tests/testapp/tasks.py) on Holdfast. "default" retries up to 3 times unless
# a task says otherwise; "once" never retries and accepts only the default queue.
TASKS = {
    "default": {
        "BACKEND": "jobs.tasks_backend.HoldfastBackend",
        "OPTIONS": {"max_attempts": 3},
    },
    "once": {
        "BACKEND": "jobs.tasks_backend.HoldfastBackend",
        "QUEUES": ["default"],
        "OPTIONS": {"max_attempts": 1, "lease_seconds": 30},
    },
}

# ...and lanes (e.g. a max_running limit shared by several worker processes).
if os.environ.get("HOLDFAST_TEST_LANES"):
    HOLDFAST_LANES = json.loads(os.environ["HOLDFAST_TEST_LANES"])

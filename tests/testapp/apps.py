import os
import time

from django.apps import AppConfig
from django.db import OperationalError

FAULT_ENV = "HOLDFAST_SPOOL_FAULT"


class TestAppConfig(AppConfig):
    name = "tests.testapp"
    label = "testapp"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        install_spool_fault(os.environ.get(FAULT_ENV, ""))


def install_spool_fault(point: str) -> None:
    """Process tests make a subprocess's spool writer fail at one point, via the env."""
    from ingestion import spool
    from jobs.log import get_logger

    log = get_logger("tests.faults")

    def db_error() -> None:
        raise OperationalError("injected fault: the database refused the batch")

    def pause() -> None:
        log.warning("spool_fault_paused", pid=os.getpid())
        time.sleep(120)

    def exit_now() -> None:
        log.warning("spool_fault_exiting", pid=os.getpid())
        os._exit(70)

    actions = {"db_error": db_error, "pause_in_flush": pause, "exit_after_commit": exit_now}
    if point in actions:
        spool.FAULTS[point] = actions[point]

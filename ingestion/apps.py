from typing import Any

from django.apps import AppConfig


class IngestionConfig(AppConfig):
    name = "ingestion"
    verbose_name = "Holdfast ingestion"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # jobs never imports ingestion (DESIGN): the spool's backlog joins queue_status here.
        from jobs.status import register_section

        from . import reconciliation  # noqa: F401  (registers its retention pruner)
        from .spool import Spool

        register_section("spool", lambda: Spool.from_settings().backlog(), render_spool)


def render_spool(backlog: dict[str, Any]) -> list[str]:
    """``queue_status``'s spool line: backlog, oldest file, and the grace alert."""
    if backlog.get("error"):
        return [f"spool: {backlog['error']}"]
    line = f"spool: {backlog['pending']} pending"
    if backlog["oldest_file"] is not None:
        line += f", oldest {backlog['oldest_file']} waiting {backlog['oldest_age_s']:.1f}s"
    grace = backlog["grace_s"]
    line += f" (grace {grace:g}s)" if grace else " (grace check off)"
    if backlog["stale"]:
        line += "  OVERDUE: older than the grace period, the ingester stops on it"
    return [line]

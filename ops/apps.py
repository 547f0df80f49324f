from django.apps import AppConfig


class OpsConfig(AppConfig):
    """The operators' internal HTTP API and its tokens (DESIGN §9)."""

    name = "ops"
    verbose_name = "Holdfast operator API"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # As jobs does: django.tasks registers its system checks only once imported, so
        # `manage.py check` reports the Tasks backend's (holdfast.E010-E012) on a clean
        # start, also where 'jobs' itself is missing from INSTALLED_APPS (E010).
        import django.tasks  # noqa: F401

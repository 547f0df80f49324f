from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "jobs"
    verbose_name = "Holdfast jobs"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks, defaults, log  # noqa: F401  (checks registers on import)

        defaults.apply()
        log.configure()

from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "jobs"
    verbose_name = "Holdfast jobs"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # django.tasks registers its system checks (and so the Tasks backend's own,
        # holdfast.E010-E012) only once imported: import it now, so `manage.py check` on a
        # clean start reports a bad TASKS setting instead of the first enqueue.
        import django.tasks  # noqa: F401
        from django.db.backends.signals import connection_created

        from . import checks, defaults, log, sql  # noqa: F401  (checks registers on import)

        defaults.apply()
        log.configure()
        connection_created.connect(sql.configure_session, dispatch_uid="holdfast.session")

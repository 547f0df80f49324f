from django.apps import AppConfig


class OpsConfig(AppConfig):
    """The operators' internal HTTP API and its tokens (DESIGN §9)."""

    name = "ops"
    verbose_name = "Holdfast operator API"
    default_auto_field = "django.db.models.BigAutoField"

from django.apps import AppConfig


class IngestionConfig(AppConfig):
    name = "ingestion"
    verbose_name = "Holdfast ingestion"
    default_auto_field = "django.db.models.BigAutoField"

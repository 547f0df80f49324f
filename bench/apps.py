from django.apps import AppConfig


class BenchConfig(AppConfig):
    name = "bench"
    label = "bench"
    verbose_name = "Holdfast benchmarks"
    default_auto_field = "django.db.models.BigAutoField"

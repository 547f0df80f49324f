from django.apps import AppConfig


class DemoConfig(AppConfig):
    """Sample job kinds for ``make demo``: they show success, retry and death."""

    name = "demo"
    verbose_name = "Holdfast demo"

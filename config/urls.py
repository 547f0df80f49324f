"""URL configuration. The internal operator API is mounted under /internal/v1/."""

from django.urls import URLPattern, URLResolver

urlpatterns: list[URLPattern | URLResolver] = []

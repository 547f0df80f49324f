"""URL configuration. The internal operator API is mounted under /internal/v1/.

Every URL answers JSON, also where no view matches (404) and on an unexpected error (500).
"""

from django.urls import URLPattern, URLResolver, include, path

urlpatterns: list[URLPattern | URLResolver] = [
    path("internal/v1/", include("ops.urls")),
]

handler400 = "ops.exceptions.bad_request"
handler403 = "ops.exceptions.forbidden"
handler404 = "ops.exceptions.not_found"
handler500 = "ops.exceptions.server_error"

"""WSGI entry point. A chunked request body is read before Django sees it (ops.wsgi)."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
django_application = get_wsgi_application()

from ops.wsgi import ChunkedBodies  # noqa: E402  (needs the settings configured above)

application = ChunkedBodies(django_application)

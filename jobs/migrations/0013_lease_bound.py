"""Jobs stored with a lease past a day (``jobs.options.MAX_LEASE_SECONDS``) get a day.

Why: until the bound, ``enqueue(lease_seconds=1e12)`` was accepted, and such a job is
poison: on SQLite every claim of it fails, on PostgreSQL its claim committed an expiry in
the year 33715, so it stays ``running`` and is never reclaimed. The bound keeps new ones
out; this repairs those already stored: their lease becomes a day and a running one's
expiry at most a day from now (it is then reclaimed as any other). A data change only,
matching no row on an install that never had one (two filtered updates, no lock held
beyond the rows they change).
"""

from datetime import timedelta
from typing import Any

from django.db import migrations
from django.utils import timezone

MAX_LEASE_SECONDS = 86_400.0  # as jobs.options: a migration keeps its own copy


def bound_leases(apps: Any, schema_editor: Any) -> None:
    Job = apps.get_model("jobs", "Job")
    using = schema_editor.connection.alias
    Job.objects.using(using).filter(lease_seconds__gt=MAX_LEASE_SECONDS).update(
        lease_seconds=MAX_LEASE_SECONDS
    )
    horizon = timezone.now() + timedelta(seconds=MAX_LEASE_SECONDS)
    Job.objects.using(using).filter(state="running", lease_expires_at__gt=horizon).update(
        lease_expires_at=horizon
    )


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0012_i16_rowid_ids"),
    ]

    operations = [migrations.RunPython(bound_leases, migrations.RunPython.noop, elidable=True)]

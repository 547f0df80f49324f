"""One open issue per condition: a partial unique index over open issues (but quarantined
submissions). Open duplicates an earlier race left are resolved first, the oldest kept."""

from typing import Any

from django.db import migrations, models
from django.db.models import Count, Min
from django.db.models.functions import Now


def resolve_duplicates(apps: Any, schema_editor: Any) -> None:
    issue = apps.get_model("ingestion", "ReconciliationIssue")
    open_issues = issue.objects.filter(status="open").exclude(kind="quarantined_submission")
    groups = (
        open_issues.values("kind", "source", "subject")
        .annotate(n=Count("id"), first=Min("id"))
        .filter(n__gt=1)
        .order_by()
    )
    for group in groups.iterator():
        open_issues.filter(
            kind=group["kind"], source=group["source"], subject=group["subject"]
        ).exclude(pk=group["first"]).update(
            status="resolved",
            resolved_at=Now(),
            resolved_by="holdfast",
            comment=f"a duplicate of issue {group['first']}, still open",
        )


class Migration(migrations.Migration):
    dependencies = [
        ("ingestion", "0007_i14_sources_hardening"),
    ]

    operations = [
        migrations.RunPython(resolve_duplicates, migrations.RunPython.noop),
        migrations.AddConstraint(
            model_name="reconciliationissue",
            constraint=models.UniqueConstraint(
                condition=models.Q(("status", "open"))
                & ~models.Q(("kind", "quarantined_submission")),
                fields=("kind", "source", "subject"),
                name="issue_open_once",
            ),
        ),
    ]

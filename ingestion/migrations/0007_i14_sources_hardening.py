"""Issue 14: sources may reach private addresses only when added with --allow-private;
artifacts count fetches that kept failing; discovery pages become rows (no quadratic
cursor); runs record failed pages and whether a feed was read exhaustively."""

from typing import Any

import django.db.models.deletion
from django.db import migrations, models


def pages_from_cursor(apps: Any, schema_editor: Any) -> None:
    """A run in progress keeps its place: its visited pages become read rows, its cursor
    pending rows (in cursor order)."""
    run_model = apps.get_model("ingestion", "DiscoveryRun")
    page_model = apps.get_model("ingestion", "DiscoveryPage")
    for run in run_model.objects.filter(state="running"):
        rows, seen = [], set()
        for url, state in [
            *((u, "read") for u in run.visited),
            *((u, "pending") for u in run.cursor),
        ]:
            if url not in seen:
                seen.add(url)
                rows.append(page_model(run=run, url=url, state=state))
        page_model.objects.bulk_create(rows, batch_size=500)
        run_model.objects.filter(pk=run.pk).update(known_pages=len(rows))


class Migration(migrations.Migration):
    dependencies = [
        ("ingestion", "0006_discovery_visited"),
    ]

    operations = [
        migrations.CreateModel(
            name="DiscoveryPage",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("url", models.TextField()),
                (
                    "state",
                    models.CharField(
                        choices=[("pending", "Pending"), ("read", "Read"), ("failed", "Failed")],
                        default="pending",
                        max_length=10,
                    ),
                ),
                (
                    "tries",
                    models.PositiveSmallIntegerField(
                        default=0, help_text="transient failures so far"
                    ),
                ),
                ("error", models.TextField(blank=True, default="")),
            ],
            options={
                "db_table": "discovery_pages",
            },
        ),
        migrations.RemoveIndex(
            model_name="artifact",
            name="artifact_refresh_due_idx",
        ),
        migrations.AddField(
            model_name="artifact",
            name="failures",
            field=models.PositiveIntegerField(
                default=0,
                help_text="fetches in a row whose transient errors outlasted their retries",
            ),
        ),
        migrations.AddField(
            model_name="discoveryrun",
            name="exhaustive",
            field=models.BooleanField(
                default=False, help_text="feeds: a complete feed or a full archive was read"
            ),
        ),
        migrations.AddField(
            model_name="discoveryrun",
            name="failed_pages",
            field=models.PositiveIntegerField(
                default=0,
                help_text="listing pages given up on: the run cannot tell what is missing",
            ),
        ),
        migrations.AddField(
            model_name="source",
            name="allow_private",
            field=models.BooleanField(
                default=False,
                help_text="may reach loopback, private and link-local addresses (add_source flag)",
            ),
        ),
        migrations.AlterField(
            model_name="reconciliationissue",
            name="kind",
            field=models.CharField(
                choices=[
                    ("quarantined_submission", "Quarantined Submission"),
                    ("gone_at_source", "Gone At Source"),
                    ("missing_from_source", "Missing From Source"),
                    ("content_changed_unannounced", "Content Changed Unannounced"),
                    ("permanent_fetch_failure", "Permanent Fetch Failure"),
                    ("fetch_failing", "Fetch Failing"),
                    ("listing_failed", "Listing Failed"),
                ],
                max_length=50,
            ),
        ),
        migrations.AddIndex(
            model_name="artifact",
            index=models.Index(
                condition=models.Q(("refresh_after__isnull", False)),
                fields=["refresh_after"],
                name="artifact_refresh_due_idx",
            ),
        ),
        migrations.AddField(
            model_name="discoverypage",
            name="run",
            field=models.ForeignKey(
                on_delete=django.db.models.deletion.CASCADE,
                related_name="page_rows",
                to="ingestion.discoveryrun",
            ),
        ),
        migrations.AddIndex(
            model_name="discoverypage",
            index=models.Index(fields=["run", "state", "id"], name="discovery_page_cursor_idx"),
        ),
        migrations.AddConstraint(
            model_name="discoverypage",
            constraint=models.UniqueConstraint(
                fields=("run", "url"), name="discovery_page_identity"
            ),
        ),
        migrations.AddField(
            model_name="discoveryrun",
            name="known_pages",
            field=models.PositiveIntegerField(default=0, help_text="page rows of this run"),
        ),
        migrations.AlterField(
            model_name="discoveryrun",
            name="pages",
            field=models.PositiveIntegerField(default=0, help_text="listing pages read"),
        ),
        migrations.RunPython(pages_from_cursor, migrations.RunPython.noop),
        migrations.RemoveField(
            model_name="discoveryrun",
            name="cursor",
        ),
        migrations.RemoveField(
            model_name="discoveryrun",
            name="visited",
        ),
    ]

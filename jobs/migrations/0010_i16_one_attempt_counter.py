"""One attempt counter: ``jobs_outcomecount`` (migration 0007) replaces ``jobs_attemptcount``.

The counts in ``jobs_attemptcount`` move over first, as rows of no lane and no state
(``''``): the metrics sum every row by (kind, outcome, bucket), so no counter goes back;
the finished jobs' counts read only rows of a finished state, so they do not count twice
(those jobs are already in ``jobs_jobcount``). Only builds between 0.1 and this one wrote
``jobs_attemptcount``; workers of 0.1 never did.
"""

from typing import Any

from django.db import migrations

FOLD = """
INSERT INTO jobs_outcomecount (kind, lane, outcome, state, bucket, shard, count, seconds)
SELECT kind, '', outcome, '', bucket, shard, sum(count), sum(seconds)
FROM jobs_attemptcount
GROUP BY kind, outcome, bucket, shard
"""


def fold_counts(apps: Any, schema_editor: Any) -> None:
    schema_editor.execute(FOLD)


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0009_i16_blocked_jobs"),
    ]

    operations = [
        migrations.RunPython(fold_counts, migrations.RunPython.noop),
        migrations.RemoveConstraint(
            model_name="attemptcount",
            name="attempt_count_key",
        ),
        migrations.DeleteModel(
            name="AttemptCount",
        ),
    ]

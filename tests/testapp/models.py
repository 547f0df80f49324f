from django.db import models


class Effect(models.Model):
    """A domain write made by a test handler: counting rows per job proves exactly-once."""

    job_id = models.BigIntegerField()
    attempt = models.PositiveIntegerField()
    lease_token = models.BigIntegerField()
    label = models.CharField(max_length=50, default="")
    worker_id = models.CharField(max_length=200, default="")

    def __str__(self) -> str:
        return f"{self.label} effect of job {self.job_id} (token {self.lease_token})"


class Document(models.Model):
    """A row with a refresh TTL, like an artifact: the refresher hook's test subject."""

    url = models.CharField(max_length=200, unique=True)
    refresh_after = models.DateTimeField()
    refreshed = models.PositiveIntegerField(default=0)

    def __str__(self) -> str:
        return self.url


class Span(models.Model):
    """When one attempt of a lock-holding job ran, by the database clock.

    ``started_at`` commits in a fenced block as the handler starts, ``ended_at`` together
    with the job's completion: conflicting jobs' spans must never overlap (I8).
    """

    job_id = models.BigIntegerField()
    lease_token = models.BigIntegerField()
    resources = models.JSONField(default=list)
    worker_id = models.CharField(max_length=200, default="")
    started_at = models.DateTimeField()
    ended_at = models.DateTimeField(null=True)

    def __str__(self) -> str:
        return f"span of job {self.job_id} (token {self.lease_token})"

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

"""Routes of the internal API, mounted at ``/internal/v1/`` by ``config/urls.py``."""

from django.urls import path

from . import views

app_name = "ops"

urlpatterns = [
    path("queue/", views.QueueView.as_view(), name="queue"),
    path("dead-jobs/", views.DeadJobsView.as_view(), name="dead-jobs"),
    path("dead-jobs/requeue/", views.RequeueDeadView.as_view(), name="dead-jobs-requeue"),
    path("jobs/<int:job_id>/", views.JobView.as_view(), name="job"),
    path("jobs/<int:job_id>/requeue/", views.RequeueView.as_view(), name="job-requeue"),
    path("jobs/<int:job_id>/cancel/", views.CancelView.as_view(), name="job-cancel"),
    path("reconciliation-issues/", views.IssuesView.as_view(), name="issues"),
    path(
        "reconciliation-issues/<int:issue_id>/resolve/",
        views.ResolveView.as_view(),
        name="issue-resolve",
    ),
    path("search/", views.SearchView.as_view(), name="search"),
    path("health/", views.HealthView.as_view(), name="health"),
    path("metrics/", views.MetricsView.as_view(), name="metrics"),
    path("schema/", views.SchemaView.as_view(), name="schema"),
]

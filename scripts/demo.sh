#!/usr/bin/env bash
# A five-minute tour of Holdfast on the embedded SQLite database (var/holdfast.sqlite3).
# Safe to run again: each run adds another batch of sample jobs.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/bootstrap.sh

unset DATABASE_URL TEST_DATABASE_URL
export PYTHONUNBUFFERED=1
export LOG_FORMAT=console  # readable log lines even when the output is not a terminal
PY=.venv/bin/python

step() {
    echo
    echo "== $1 =="
    shift
    for line in "$@"; do echo "   $line"; done
    echo
}

step "1. Create or update the database" \
    "Holdfast uses SQLite under var/ when DATABASE_URL is unset; PostgreSQL in production."
"$PY" manage.py migrate --noinput -v0
echo "   database ready: var/holdfast.sqlite3"

step "2. Enqueue sample jobs (manage.py seed_demo)" \
    "Some succeed, some fail at first and succeed on a retry, one keeps failing and goes dead."
"$PY" manage.py seed_demo

step "3. Run a worker until no runnable job remains (manage.py runworker --burst)" \
    "A real deployment runs 'manage.py runworker' under a process manager, without --burst." \
    "Each line is a structured log event: claims, retries, successes, the dead job."
"$PY" manage.py runworker --burst

step "4. Look at the queue (manage.py queue_status)" \
    "Counts per lane and state, the oldest queued job, live leases, dead jobs, workers."
"$PY" manage.py queue_status

step "5. Inspect dead jobs (manage.py list_jobs --state dead)" \
    "A dead job used up its attempts or raised PermanentError; nothing retries it until an" \
    "operator runs 'manage.py requeue_dead'."
"$PY" manage.py list_jobs --state dead

dead_id=$("$PY" manage.py list_jobs --state dead --json | "$PY" -c '
import json, sys
jobs = json.load(sys.stdin)["jobs"]
print(jobs[0]["id"] if jobs else "")
')

if [[ -z "$dead_id" ]]; then
    echo "   (no dead job: unexpected, seed_demo should leave one)"
    exit 1
fi

step "6. One dead job in detail (manage.py show_job $dead_id)" \
    "Every attempt is a lease row: worker, times, outcome, error and traceback."
"$PY" manage.py show_job "$dead_id"

SPOOL="${HOLDFAST_SPOOL_DIR:-${HOLDFAST_VAR_DIR:-var}/spool}"
mkdir -p "$SPOOL/incoming"
step "7. Labs submit results: sample files into the spool ($SPOOL/incoming)" \
    "demo/submissions/: two labs, a newer fact for the same run, and one broken file." \
    "Producers write a dot-file, then rename it, so the ingester never reads half a file."
for sample in demo/submissions/*.json; do
    name=$(basename "$sample")
    cp "$sample" "$SPOOL/incoming/.$name.partial"
    mv "$SPOOL/incoming/.$name.partial" "$SPOOL/incoming/$name"
    echo "   dropped $name"
done

step "8. Apply them (manage.py ingest_submissions --once)" \
    "Valid submissions apply exactly once (facts + ack row in one transaction, then the" \
    "file is deleted); the broken one moves to failed/ with a reason."
"$PY" manage.py ingest_submissions --once
"$PY" manage.py shell -v0 -c '
from ingestion.models import Fact
for fact in Fact.objects.select_related("lab").order_by("lab__name", "entity", "key"):
    print(f"   {fact.lab.name:<13} {fact.entity:<7} {fact.key:<7} {fact.attributes}")
'
echo "   (run-42 shows the newer submission's status, whatever the order the files arrived in)"

step "9. The quarantined submission (manage.py list_reconciliation_issues)" \
    "Its reason sits beside it in failed/; fix it and move it back to incoming/ to retry."
"$PY" manage.py list_reconciliation_issues --kind quarantined_submission
for reason in "$SPOOL"/failed/*.reason.json; do
    echo "   $reason:"
    sed 's/^/     /' "$reason"
done

echo
echo "== Done =="
echo "   Try next:  .venv/bin/python manage.py requeue_dead $dead_id"
echo "              .venv/bin/python manage.py runworker --burst"
echo "              .venv/bin/python manage.py queue_status   # includes the spool's backlog"
echo "   Start over: rm -rf var && scripts/demo.sh"

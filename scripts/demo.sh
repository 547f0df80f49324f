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

echo
echo "== Done =="
echo "   Try next:  .venv/bin/python manage.py requeue_dead $dead_id"
echo "              .venv/bin/python manage.py runworker --burst"
echo "   Start over: rm -rf var && scripts/demo.sh"

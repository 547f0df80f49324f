#!/usr/bin/env bash
# Run the whole test suite on SQLite and on PostgreSQL (what `make test` and CI run).
#
#   scripts/test.sh [pytest args...]             # both databases, e.g. -x -k lease
#   HOLDFAST_TEST_DBS=sqlite scripts/test.sh     # one database only: sqlite | postgres
#
# PostgreSQL is found in this order:
#   1. $TEST_DATABASE_URL
#   2. $DATABASE_URL, if it is a postgres:// URL
#   3. a server on 127.0.0.1:5432 that lets user `postgres` in without a password
#      (uses postgres://postgres@127.0.0.1:5432/holdfast, creating that database if needed)
#   4. a throwaway cluster started with tests/support/pgcluster.py, removed at exit.
# No PostgreSQL at all is an error, never a silent skip.
#
# Both runs always happen; the exit status is non-zero if either failed. pytest's exit 5
# ("no tests collected") counts as a failure.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1

bash scripts/bootstrap.sh || exit 1

PY=.venv/bin/python
export PYTHONUNBUFFERED=1

fail() {
    echo "test.sh: $*" >&2
    exit 1
}

# -- which databases ---------------------------------------------------------------------
run_sqlite=0
run_postgres=0
for db in $(tr ',' ' ' <<<"${HOLDFAST_TEST_DBS:-sqlite,postgres}"); do
    case "$db" in
        sqlite) run_sqlite=1 ;;
        postgres | postgresql | pg) run_postgres=1 ;;
        both | all) run_sqlite=1 run_postgres=1 ;;
        *) fail "HOLDFAST_TEST_DBS: unknown database '$db' (use sqlite, postgres or both)" ;;
    esac
done
((run_sqlite + run_postgres > 0)) || fail "HOLDFAST_TEST_DBS names no database"

# -- find PostgreSQL ---------------------------------------------------------------------
is_postgres_url() { [[ "$1" =~ ^postgres(ql)?(\+[a-z0-9]+)?:// ]]; }

# Succeeds if postgres@127.0.0.1:5432 lets us in (else says why on stderr), and makes sure the
# `holdfast` database exists there.
local_server_ok() {
    "$PY" - <<'EOF'
import sys

try:
    import psycopg

    with psycopg.connect(
        "postgres://postgres@127.0.0.1:5432/postgres", connect_timeout=3, autocommit=True
    ) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = 'holdfast'").fetchone():
            conn.execute("CREATE DATABASE holdfast")
except Exception as exc:
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    print(f"test.sh: no usable PostgreSQL on 127.0.0.1:5432: {reason}", file=sys.stderr)
    sys.exit(1)
EOF
}

PG_TMP=""
# shellcheck disable=SC2329  # invoked by the EXIT trap
cleanup() {
    if [[ -n "$PG_TMP" ]]; then
        "$PY" -m tests.support.pgcluster stop "$PG_TMP" --remove >&2 || true
        rm -rf "$PG_TMP"
        PG_TMP=""
    fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

pg_url=""
if ((run_postgres)); then
    if [[ -n "${TEST_DATABASE_URL:-}" ]]; then
        is_postgres_url "$TEST_DATABASE_URL" || fail "TEST_DATABASE_URL is not a postgres:// URL"
        pg_url=$TEST_DATABASE_URL
        pg_source="TEST_DATABASE_URL"
    elif [[ -n "${DATABASE_URL:-}" ]] && is_postgres_url "$DATABASE_URL"; then
        pg_url=$DATABASE_URL
        pg_source="DATABASE_URL"
    elif local_server_ok; then
        pg_url="postgres://postgres@127.0.0.1:5432/holdfast"
        pg_source="the server on 127.0.0.1:5432"
    else
        echo "test.sh: starting a throwaway PostgreSQL cluster (tests/support/pgcluster.py)" >&2
        PG_TMP=$(mktemp -d "${TMPDIR:-/tmp}/holdfast-test-pg.XXXXXX") || fail "mktemp failed"
        if ! pg_url=$("$PY" -m tests.support.pgcluster start "$PG_TMP"); then
            fail "no PostgreSQL for the tests: nothing at TEST_DATABASE_URL/DATABASE_URL or" \
                "127.0.0.1:5432, and no throwaway cluster could be started (see above)." \
                "Install PostgreSQL (e.g. apt-get install postgresql), set TEST_DATABASE_URL," \
                "or run SQLite only with HOLDFAST_TEST_DBS=sqlite."
        fi
        pg_source="a throwaway cluster in $PG_TMP"
    fi
fi

# -- run ---------------------------------------------------------------------------------
declare -A result=()
order=()

# record LABEL RC -> remembers the verdict of one run
record() {
    order+=("$1")
    case $2 in
        0) result[$1]="passed" ;;
        5) result[$1]="FAILED (pytest collected no tests)" ;;
        *) result[$1]="FAILED (pytest exit $2)" ;;
    esac
}

if ((run_sqlite)); then
    echo
    echo "== tests on SQLite =="
    (
        unset DATABASE_URL TEST_DATABASE_URL
        exec "$PY" -m pytest "$@"
    )
    record SQLite $?
fi

if ((run_postgres)); then
    shown_url=$(sed -E 's#(://[^:/@]*):[^@/]*@#\1:***@#' <<<"$pg_url")
    echo
    echo "== tests on PostgreSQL ($shown_url, from $pg_source) =="
    # The PgBouncer tests fail without PgBouncer: say so before they run, never skip silently.
    if ! command -v pgbouncer >/dev/null && [[ ! -x /usr/sbin/pgbouncer ]] &&
        [[ ! -x ${PGBOUNCER:-/nonexistent} ]]; then
        if [[ ${HOLDFAST_SKIP_PGBOUNCER:-} == 1 ]]; then
            echo "test.sh: !!! PgBouncer is not installed: SKIPPING the PgBouncer tests" \
                "(HOLDFAST_SKIP_PGBOUNCER=1) !!!" >&2
        else
            echo "test.sh: !!! PgBouncer is not installed: the PgBouncer tests" \
                "(tests/process/test_pgbouncer.py) will FAIL. Install it (apt-get install -y" \
                "pgbouncer), or set HOLDFAST_SKIP_PGBOUNCER=1 to skip them knowingly !!!" >&2
        fi
    fi
    DATABASE_URL=$pg_url "$PY" -m pytest "$@"
    record PostgreSQL $?
fi

echo
status=0
summary=""
for label in "${order[@]}"; do
    summary+="${summary:+; }$label ${result[$label]}"
    [[ "${result[$label]}" == passed ]] || status=1
done
echo "== test summary: $summary =="
exit $status

#!/usr/bin/env bash
# Set up (or refresh) the project's virtualenv in .venv. Safe to run any number of times:
# a second run with nothing changed takes well under a second.
#
#  1. Finds a Python >= 3.12: $PYTHON, python3.13, python3.12, pyenv's versions
#     ($(pyenv root)/versions or ~/.pyenv/versions, newest first), then python3.
#  2. Creates .venv with it, unless .venv already holds a working Python >= 3.12.
#  3. Runs `pip install -e '.[dev]'` only when pyproject.toml (or the set of top-level
#     packages, which an editable install records) changed since the last install; the
#     stamp lives in .venv/.holdfast-install-stamp.
# Progress goes to stderr, so callers may capture stdout.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV=.venv
STAMP="$VENV/.holdfast-install-stamp"
MIN_CHECK='import sys, venv, ensurepip; sys.exit(0 if sys.version_info >= (3, 12) else 1)'

say() { echo "bootstrap: $*" >&2; }

# usable PYTHON -> true if PYTHON runs and is >= 3.12 with venv/ensurepip available
usable() {
    local candidate=$1
    [[ -n "$candidate" ]] || return 1
    command -v "$candidate" >/dev/null 2>&1 || [[ -x "$candidate" ]] || return 1
    "$candidate" -c "$MIN_CHECK" >/dev/null 2>&1
}

find_python() {
    if [[ -n "${PYTHON:-}" ]]; then
        if usable "$PYTHON"; then
            echo "$PYTHON"
            return 0
        fi
        say "PYTHON=$PYTHON is not a working Python >= 3.12 (with the venv module)"
        return 1
    fi
    local candidate roots=() root
    for candidate in python3.13 python3.12; do
        if usable "$candidate"; then
            echo "$candidate"
            return 0
        fi
    done
    if command -v pyenv >/dev/null 2>&1 && root=$(pyenv root 2>/dev/null); then
        roots+=("$root")
    fi
    roots+=("${PYENV_ROOT:-$HOME/.pyenv}" "$HOME/.pyenv")
    for root in "${roots[@]}"; do
        # newest first: 3.13.x before 3.12.x
        while IFS= read -r candidate; do
            if usable "$candidate"; then
                echo "$candidate"
                return 0
            fi
        done < <(compgen -G "$root/versions/3.1[2-9]*/bin/python" | sort -rV)
    done
    if usable python3; then
        echo python3
        return 0
    fi
    return 1
}

venv_ok() {
    [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c "$MIN_CHECK" >/dev/null 2>&1 \
        && [[ -x "$VENV/bin/pip" ]]
}

if ! venv_ok; then
    if ! PY=$(find_python); then
        cat >&2 <<'EOF'
bootstrap: no Python >= 3.12 found (tried $PYTHON, python3.13, python3.12, pyenv versions, python3).
bootstrap: install Python 3.12+ (e.g. `apt install python3.12 python3.12-venv` or
bootstrap: `pyenv install 3.13`) or point PYTHON= at one, then run this again.
EOF
        exit 1
    fi
    say "creating $VENV with $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
fi

# What an editable install depends on: pyproject.toml, and which top-level packages exist
# (setuptools maps each package it found at install time; a new one needs a reinstall).
packages=$(compgen -G '*/__init__.py' | sed 's#/__init__.py$##' | sort | tr '\n' ' ' || true)
want="$("$VENV/bin/python" -c 'import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest())' pyproject.toml) packages: ${packages% }"
have=$(cat "$STAMP" 2>/dev/null || true)

if [[ "$want" != "$have" ]]; then
    say "installing dependencies into $VENV (pip install -e '.[dev]')"
    rm -f "$STAMP"
    log="$VENV/.holdfast-pip.log"
    if ! PIP_DISABLE_PIP_VERSION_CHECK=1 "$VENV/bin/python" -m pip install -q -e '.[dev]' >"$log" 2>&1; then
        cat "$log" >&2
        say "pip install failed (full output above, also in $log)"
        exit 1
    fi
    echo "$want" >"$STAMP"
    say "done"
fi

#!/usr/bin/env bash
# Builds and tests the Python package: a cached venv, `pip install ./python` (the wheel that
# users get, built by maturin through pip), ruff and pytest. Idempotent; fast when warm (the
# extension is rebuilt by cargo incrementally in the workspace's target directory).
#
#   python/run-tests.sh [pytest args...]
#
# HANDOFF_PYENV: the venv (default ~/.cache/handoff/pyenv). PYTHON: the interpreter (python3).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${HANDOFF_PYENV:-$HOME/.cache/handoff/pyenv}"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
    echo "run-tests: creating $venv"
    "$python" -m venv "$venv"
fi
# Tools first (once: pip skips what is installed).
stamp="$venv/.tools-ok"
if [ ! -f "$stamp" ]; then
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    "$venv/bin/python" -m pip install --quiet "maturin>=1.5,<2" pytest numpy ruff
    touch "$stamp"
fi

# The package as users install it (pip runs maturin, found on PATH). Cargo's shared target
# dir and a dev build (HANDOFF_PY_PROFILE=release for an optimised one) keep rebuilds
# incremental and share what `cargo test` built.
export PATH="$venv/bin:$PATH"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$here/../target}"
export MATURIN_PEP517_ARGS="${MATURIN_PEP517_ARGS:---profile ${HANDOFF_PY_PROFILE:-dev}}"
"$venv/bin/python" -m pip install --quiet --no-build-isolation --force-reinstall --no-deps "$here"

echo "run-tests: ruff"
# The package, its examples and tests, and the Python scripts beside the project's shell ones.
"$venv/bin/ruff" format --check --config "$here/pyproject.toml" "$here" "$here/../scripts"
"$venv/bin/ruff" check --config "$here/pyproject.toml" "$here" "$here/../scripts"

echo "run-tests: pytest"
cd "$here"
exec "$venv/bin/pytest" "$@"

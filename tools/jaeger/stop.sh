#!/usr/bin/env bash
# Stop a Jaeger started with `tools/jaeger/run.sh --background PIDFILE`.
#
#   tools/jaeger/stop.sh PIDFILE
#
# Sends SIGTERM, waits up to 10 s (then SIGKILL), removes PIDFILE. Exits 0 if nothing
# was running.
set -euo pipefail

[[ $# -eq 1 ]] || { echo "usage: $0 PIDFILE" >&2; exit 2; }
pidfile=$1
[[ -s $pidfile ]] || { echo "stop.sh: no pid in $pidfile; nothing to stop" >&2; exit 0; }
pid=$(cat "$pidfile")
[[ $pid =~ ^[0-9]+$ ]] || { echo "stop.sh: $pidfile does not hold a pid" >&2; exit 1; }

# Only signal it if it is a jaeger (the pid may have been reused since).
if kill -0 "$pid" 2>/dev/null; then
  if [[ -r /proc/$pid/cmdline ]]; then args=$(tr '\0' ' ' <"/proc/$pid/cmdline")
  else args=$(ps -o args= -p "$pid" 2>/dev/null || true); fi
  if [[ $args != *jaeger* ]]; then
    echo "stop.sh: pid $pid is '$args', not jaeger; leaving it alone" >&2
    rm -f "$pidfile"
    exit 0
  fi
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 100); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$pid" 2>/dev/null; then
    echo "stop.sh: jaeger (pid $pid) ignored SIGTERM; killing it" >&2
    kill -KILL "$pid" 2>/dev/null || true
  fi
fi
rm -f "$pidfile"

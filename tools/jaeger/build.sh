#!/usr/bin/env bash
# Build Jaeger v2 from the Go module proxy (once) and print the binary's path.
#
#   tools/jaeger/build.sh            # prints e.g. ~/.cache/thrift-sidecar/jaeger/jaeger-2.13.0
#   tools/jaeger/build.sh --force    # rebuild even if the cached binary exists
#
# The binary is cached outside the repository in
#   ${CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/thrift-sidecar}/jaeger/jaeger-<version>
# A cold build downloads ~1.3 GB of modules and compiles for several minutes; both go to
# the usual Go caches (GOMODCACHE, GOCACHE), which may be pointed elsewhere as usual.
# Only the path is written to stdout; progress goes to stderr.
set -euo pipefail

JAEGER_VERSION=2.13.0            # Jaeger v2 release ...
JAEGER_MODULE=github.com/jaegertracing/jaeger
JAEGER_MODULE_VERSION=v1.76.0    # ... published as this Go module version (see wrapper/go.mod)

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache=${CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/thrift-sidecar}
dir=$cache/jaeger
bin=$dir/jaeger-$JAEGER_VERSION

force=0
case "${1:-}" in
  --force) force=1 ;;
  "") ;;
  -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "usage: $0 [--force]" >&2; exit 2 ;;
esac

if [[ $force = 0 && -x $bin ]]; then
  echo "$bin"
  exit 0
fi

mkdir -p "$dir"

# One build at a time (parallel test runs may all ask for the binary).
if command -v flock >/dev/null 2>&1; then
  exec 9>"$dir/.build.lock"
  flock 9
  if [[ $force = 0 && -x $bin ]]; then
    echo "$bin"
    exit 0
  fi
fi

GO=${GO:-}
if [[ -z $GO ]]; then
  if command -v go >/dev/null 2>&1; then GO=go
  elif [[ -x /usr/local/go/bin/go ]]; then GO=/usr/local/go/bin/go
  else echo "build.sh: no Go toolchain found (set GO=/path/to/go)" >&2; exit 1
  fi
fi

grep -q "^require $JAEGER_MODULE $JAEGER_MODULE_VERSION\$" "$here/wrapper/go.mod" || {
  echo "build.sh: wrapper/go.mod does not require $JAEGER_MODULE $JAEGER_MODULE_VERSION" >&2; exit 1; }

tmp=$(mktemp "$dir/.jaeger-$JAEGER_VERSION.XXXXXX")
trap 'rm -f "$tmp"' EXIT

echo "building Jaeger $JAEGER_VERSION ($JAEGER_MODULE@$JAEGER_MODULE_VERSION) with $("$GO" version)" >&2
echo "  (a cold build takes several minutes and ~3 GB of Go caches)" >&2
start=$SECONDS
vpkg=$JAEGER_MODULE/internal/version
# GOWORK=off: never pick up a go.work from around the checkout.
# -mod=readonly: go.mod/go.sum are complete and pinned; nothing is written to the repo.
# The pinned go.sum (Jaeger's own + Jaeger's lines) means the checksum database is not
# consulted: several of Jaeger's dependencies are missing from it (404 on lookup).
(
  cd "$here/wrapper"
  GOWORK=off GOFLAGS="-mod=readonly -buildvcs=false" CGO_ENABLED=0 \
    "$GO" build -trimpath \
      -ldflags "-s -w -X $vpkg.latestVersion=v$JAEGER_VERSION -X $vpkg.commitSHA=$JAEGER_MODULE_VERSION" \
      -o "$tmp" "$JAEGER_MODULE/cmd/jaeger"
) >&2
chmod 755 "$tmp"
"$tmp" --help >/dev/null 2>&1 || { echo "build.sh: built binary does not run" >&2; exit 1; }
mv -f "$tmp" "$bin"
trap - EXIT
echo "built $bin in $((SECONDS - start)) s" >&2
echo "$bin"

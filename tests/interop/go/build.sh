#!/usr/bin/env bash
# Builds the Go interop test client (a real Apache Thrift Go client):
#
#   tests/interop/go/build.sh OUT_BINARY
#
# The Go code for tests/idl/sidecar_test.thrift is generated, and the module
# built, in a folder outside the repository:
#   ${CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/thrift-sidecar}/go-client-build/
# Go's module and build caches stay where Go keeps them by default.
#
# Nothing is rebuilt when OUT_BINARY exists and OUT_BINARY.stamp holds the
# hash of the inputs (the IDL, go.mod, go.sum, the *.go sources, this script
# and the versions of thrift and go).
#
# `go mod tidy` runs in the build copy; if it changes go.mod or go.sum they are
# copied back next to this script (commit them).
set -euo pipefail

if [ $# -ne 1 ] || [ -z "$1" ]; then
  echo "usage: $0 OUT_BINARY" >&2
  exit 2
fi

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
IDL="$ROOT/tests/idl/sidecar_test.thrift"
CACHE="${CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/thrift-sidecar}"
BUILD="$CACHE/go-client-build"
OUT=$1
case "$OUT" in /*) ;; *) OUT="$PWD/$OUT" ;; esac
STAMP="$OUT.stamp"

for tool in go thrift sha256sum; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "build.sh: '$tool' is not on PATH" >&2
    exit 1
  fi
done

inputs_hash() {
  {
    # Content only (not paths), in a fixed order.
    for f in "$IDL" "$HERE/go.mod" "$HERE/go.sum" "$HERE/build.sh" "$HERE"/*.go; do
      if [ -f "$f" ]; then
        printf '%s ' "$(basename "$f")"
        sha256sum <"$f"
      fi
    done
    thrift --version
    go version
  } | sha256sum | cut -d' ' -f1
}

up_to_date() {
  [ -x "$OUT" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$1" ]
}

HASH=$(inputs_hash)
if up_to_date "$HASH"; then
  exit 0
fi

mkdir -p "$BUILD" "$(dirname "$OUT")"

# One build at a time per cache (parallel test runs share $BUILD).
if command -v flock >/dev/null 2>&1; then
  exec 9>"$CACHE/go-client-build.lock"
  flock 9
  HASH=$(inputs_hash)
  if up_to_date "$HASH"; then
    exit 0
  fi
fi

start=${EPOCHREALTIME:-0}
trap 'rm -f "$OUT.tmp.$$"' EXIT

# Generated code: package sidecarclient/gen-go/sidecartest (IDL: namespace go).
rm -rf "$BUILD/gen-go.tmp"
mkdir "$BUILD/gen-go.tmp"
thrift --gen go:package_prefix=sidecarclient/gen-go/ -out "$BUILD/gen-go.tmp" "$IDL"
rm -rf "$BUILD"/gen-go.tmp/*/*-remote # sample CLIs, not needed
# The IDL is sidecar_test.thrift, so the generated file is sidecar_test.go,
# which Go would take for a test file: rename it.
for f in "$BUILD"/gen-go.tmp/*/*_test.go; do
  if [ -e "$f" ]; then
    mv "$f" "${f%_test.go}_test_gen.go"
  fi
done
rm -rf "$BUILD/gen-go"
mv "$BUILD/gen-go.tmp" "$BUILD/gen-go"

# Module sources.
rm -f "$BUILD"/*.go "$BUILD/go.sum"
cp "$HERE/go.mod" "$HERE"/*.go "$BUILD/"
if [ -f "$HERE/go.sum" ]; then
  cp "$HERE/go.sum" "$BUILD/"
fi

cd "$BUILD"
go mod tidy
for f in go.mod go.sum; do
  if ! cmp -s "$BUILD/$f" "$HERE/$f"; then
    cp "$BUILD/$f" "$HERE/$f"
    echo "build.sh: updated tests/interop/go/$f (from go mod tidy): commit it" >&2
  fi
done

CGO_ENABLED=0 go build -trimpath -buildvcs=false -o "$OUT.tmp.$$" .
mv -f "$OUT.tmp.$$" "$OUT"
inputs_hash >"$STAMP"

awk -v a="$start" -v b="${EPOCHREALTIME:-0}" -v o="$OUT" \
  'BEGIN { printf "build.sh: built %s in %.1fs\n", o, b - a }' >&2

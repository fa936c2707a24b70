#!/usr/bin/env bash
# Render an HTML file (e.g. `thrift-sidecar hops --html hops.html`) in headless Chromium and
# save a PNG screenshot of it.
#
#   tools/screenshot.sh HTML PNG [WIDTH,HEIGHT]     # default window 1400,900
#
# Uses Debian's `chromium` package (apt-get install -y chromium), else chromium-browser or
# google-chrome from PATH, or $CHROMIUM. Offline on purpose: no GPU, no QUIC, no first-run,
# sync, component updates or background networking, and a throw-away profile directory.
# Exits non-zero when no browser is found or no PNG was written; Chromium's own log is shown then.
set -euo pipefail

[[ $# -ge 2 && $# -le 3 ]] || { echo "usage: $0 HTML PNG [WIDTH,HEIGHT]" >&2; exit 2; }
html=$1
png=$2
size=${3:-1400,900}
[[ -f $html ]] || { echo "screenshot.sh: no such file: $html" >&2; exit 2; }

browser=${CHROMIUM:-}
if [[ -z $browser ]]; then
  for b in chromium chromium-browser google-chrome google-chrome-stable; do
    if command -v "$b" >/dev/null 2>&1; then browser=$(command -v "$b"); break; fi
  done
fi
[[ -n $browser ]] || { echo "screenshot.sh: no chromium found; install Debian's package: apt-get install -y chromium" >&2; exit 3; }

abs_html=$(cd "$(dirname "$html")" && pwd)/$(basename "$html")
mkdir -p "$(dirname "$png")"
abs_png=$(cd "$(dirname "$png")" && pwd)/$(basename "$png")
profile=$(mktemp -d "${TMPDIR:-/tmp}/screenshot-profile.XXXXXX")
log=$(mktemp "${TMPDIR:-/tmp}/screenshot-log.XXXXXX")
trap 'rm -rf "$profile" "$log"' EXIT
rm -f "$abs_png"

rc=0
timeout 60 "$browser" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
  --disable-background-networking --disable-component-update --disable-sync \
  --user-data-dir="$profile" --hide-scrollbars --screenshot="$abs_png" --window-size="$size" \
  "file://$abs_html" >"$log" 2>&1 || rc=$?

if [[ $rc != 0 || ! -s $abs_png ]]; then
  echo "screenshot.sh: $browser failed (exit $rc) or wrote no PNG; its output:" >&2
  tail -n 20 "$log" >&2 || true
  exit 1
fi
echo "$abs_png"

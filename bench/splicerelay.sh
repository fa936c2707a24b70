#!/bin/sh
# Sidecar adapter for ../shared/bench (its README, "Sidecar adapter contract"): starts
# bench/splicerelay.py, a relay that moves every byte with splice(2), in the foreground on the
# project venv's Python (SIDECAR_PYTHON overrides): the floor for a large message.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
exec "${SIDECAR_PYTHON:-$here/../.venv/bin/python}" "$here/splicerelay.py" \
    --listen "$SIDECAR_LISTEN_HOST:$SIDECAR_LISTEN_PORT" \
    --upstream "$SIDECAR_UPSTREAMS"

"""Shared fixtures for the interop tests: the Go Thrift client binary."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD_SH = ROOT / "tests" / "interop" / "go" / "build.sh"


@pytest.fixture(scope="session")
def go_client(tmp_path_factory) -> str:
    path = os.environ.get("SIDECAR_GO_CLIENT")
    if path:
        assert os.access(path, os.X_OK), f"SIDECAR_GO_CLIENT={path} is not an executable"
        return path
    cache = tmp_path_factory.mktemp("go-client-cache")
    out = cache / "bin" / "sidecar-test-client"
    proc = subprocess.run(
        [str(BUILD_SH), str(out)],
        env={**os.environ, "CACHE": str(cache)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        pytest.fail(f"build.sh failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return str(out)

"""The textual units of the config file: durations, sizes and `host:port` addresses.

Pure functions, no pydantic: `proxy.config` wires them into its models, and anything else that
reads a duration, size or address typed by a human (CLI flags, tests) can use them too. Each
parser raises `ValueError` with a short message that states the rule; `proxy.config` prints that
message after the file, line and key path. Each `format_*` is the inverse of its parser
(`parse(format(x)) == x`), so the effective config can be printed back as valid YAML.
"""

from __future__ import annotations

import ipaddress
import math
import re
from decimal import Decimal
from fractions import Fraction
from typing import NamedTuple

DURATION_RULE = "duration must look like 250ms, 2s or 1m"
SIZE_RULE = "size must be a whole number of bytes or look like 512KB or 16MiB"
ADDRESS_RULE = "address must look like host:port or [::1]:port"
MAX_DURATION = 365 * 24 * 3600  # seconds: no timer of the proxy's means more than a year
_TOO_LONG = f"duration must be at most {MAX_DURATION // 3600}h (a year)"

# Largest unit first: format_duration picks the first unit that says the value exactly.
_DURATION_UNITS: tuple[tuple[str, Fraction], ...] = (
    ("h", Fraction(3600)),
    ("m", Fraction(60)),
    ("s", Fraction(1)),
    ("ms", Fraction(1, 1000)),
    ("us", Fraction(1, 1_000_000)),
)
_DURATION_SCALE = dict(_DURATION_UNITS) | {"µs": Fraction(1, 1_000_000)}
_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)"
_DURATION_PART = re.compile(rf"({_NUMBER})(h|ms|m|s|us|µs)")
_DURATION_FULL = re.compile(rf"(?:{_NUMBER}(?:h|ms|m|s|us|µs))+")

_SIZE_SCALE = {
    "": 1, "B": 1,
    "KB": 1000, "MB": 1000**2, "GB": 1000**3,
    "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3,
}
_SIZE = re.compile(rf"({_NUMBER})\s*(B|KB|MB|GB|KiB|MiB|GiB)?")
_BINARY_UNITS = (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))

# dot-separated labels of 1-63 characters (no empty label: `a..b` cannot be encoded for a lookup)
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOSTNAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")  # (a trailing dot: fully qualified, no search path)
_DOTTED_NUMBERS = re.compile(r"[0-9.]+")  # what can only be meant as an IPv4 address


def parse_duration(value: object) -> float:
    """`250ms`, `2s`, `1.5s`, `1m`, `1h`, `500us`, `1m30s`, or a plain number of seconds → seconds."""
    if isinstance(value, bool):
        raise ValueError(DURATION_RULE)
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(DURATION_RULE)
        if value < 0:
            raise ValueError("duration must not be negative")
        if value > MAX_DURATION:  # (before float(): a 400-digit int overflows it)
            raise ValueError(_TOO_LONG)
        return float(value)
    if not isinstance(value, str):
        raise ValueError(DURATION_RULE)
    text = value.strip()
    if text.startswith("-"):
        raise ValueError("duration must not be negative")
    if re.fullmatch(_NUMBER, text):
        total = Fraction(text)
    elif _DURATION_FULL.fullmatch(text):
        total = sum((Fraction(number) * _DURATION_SCALE[unit]
                     for number, unit in _DURATION_PART.findall(text)), Fraction(0))
    else:
        raise ValueError(DURATION_RULE)
    if total > MAX_DURATION:
        raise ValueError(_TOO_LONG)
    return float(total)  # Fraction → float rounds once, so "1.7ms" is the float nearest 0.0017


def format_duration(seconds: float) -> str:
    """A short form that parses back to exactly `seconds`: `0.25` → `250ms`, `1.5` → `1.5s`."""
    if seconds == 0:
        return "0s"
    for unit, scale in _DURATION_UNITS:
        count = Fraction(seconds) / scale
        if count < 1:
            continue
        # hours and minutes only when whole (90s, not 1.5m); smaller units with up to 3 decimals
        digits = 0 if unit in ("h", "m") else 3
        rounded = round(count, digits)
        text = f"{Decimal(rounded.numerator) / rounded.denominator:f}"
        text = text.rstrip("0").rstrip(".") if "." in text else text
        if parse_duration(text + unit) == seconds:
            return text + unit
    return f"{Decimal(repr(seconds)):f}s"  # repr is the shortest exact form; :f avoids 1e-07


def parse_size(value: object) -> int:
    """A whole number of bytes, or `512B`, `512KB`, `1MB`, `1KiB`, `16MiB`, `1.5GiB` → bytes."""
    if isinstance(value, bool):
        raise ValueError(SIZE_RULE)
    if isinstance(value, int):
        if value < 0:
            raise ValueError("size must not be negative")
        return value
    if not isinstance(value, str):
        raise ValueError(SIZE_RULE)
    text = value.strip()
    if text.startswith("-"):
        raise ValueError("size must not be negative")
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ValueError(SIZE_RULE)
    number, unit = match.groups()
    size = Fraction(number) * _SIZE_SCALE[unit or ""]
    if size.denominator != 1:
        raise ValueError(f"size must be a whole number of bytes, not {float(size)}")
    return int(size)


def format_size(size: int) -> int | str:
    """`1048576` → `1MiB`, `524288` → `512KiB`; anything else stays a plain byte count."""
    for unit, scale in _BINARY_UNITS:
        if size and size % scale == 0 and size // scale < 1024:
            return f"{size // scale}{unit}"
    return size


class Address(NamedTuple):
    """A `host:port` pair; `host` is an IP address or a host name, IPv6 without brackets."""

    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


def parse_address(value: object, *, allow_port_zero: bool = False) -> Address:
    """`127.0.0.1:9090`, `users.internal:9090` or `[::1]:9090` → Address.

    Port 0 ("any free port", for listeners in tests) only with `allow_port_zero`.
    """
    if not isinstance(value, str):
        raise ValueError(ADDRESS_RULE)
    text = value.strip()
    scheme, sep, rest = text.partition("://")
    if sep and scheme.isalpha():
        raise ValueError(f"must be host:port, not a URL: write {rest.rstrip('/') or 'host:port'}")
    if text.startswith("["):
        host, sep, port_text = text[1:].partition("]:")
        if not sep:
            raise ValueError(ADDRESS_RULE)
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"'{host}' is not an IPv6 address") from None
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or not host:
            raise ValueError(ADDRESS_RULE)
        if ":" in host:
            raise ValueError("write IPv6 addresses in brackets, like [::1]:9090")
        if not _HOSTNAME.fullmatch(host) or len(host.rstrip(".")) > 253:
            raise ValueError(f"'{host}' is not a host name or IP address")
        if _DOTTED_NUMBERS.fullmatch(host):  # (a top-level domain is never all digits)
            try:
                ipaddress.IPv4Address(host)
            except ValueError:
                raise ValueError(f"'{host}' is not an IPv4 address") from None
    low = 0 if allow_port_zero else 1
    if not (port_text.isascii() and port_text.isdigit()) or not low <= int(port_text) <= 65535:
        raise ValueError(f"port must be {low}-65535")
    return Address(host, int(port_text))

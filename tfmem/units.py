"""Byte quantities: parse ``"1.5GiB"``-style strings and format integers for people.

Examples
--------
>>> parse_bytes("1.5GiB")
1610612736
>>> parse_bytes(4096)
4096
>>> format_bytes(3 * 2**20)
'3.00 MiB'
"""

from __future__ import annotations

import re

from tfmem.errors import BadInputError

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 2**10,
    "m": 10**6, "mb": 10**6, "mib": 2**20,
    "g": 10**9, "gb": 10**9, "gib": 2**30,
    "t": 10**12, "tb": 10**12, "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str, *, what: str = "size") -> int:
    """Return ``value`` as an integer number of bytes.

    Accepts non-negative ints, floats, and strings such as ``"512MiB"``, ``"1.5GiB"``, ``"12GB"``, ``"800k"``.
    Binary units (KiB, MiB, GiB, TiB) are powers of 1024; decimal ones (KB, MB, GB, TB) powers of 1000.

    Raises
    ------
    BadInputError
        If the value is negative or not a recognisable size; the message names ``what`` and shows a valid form.
    """
    if isinstance(value, bool):
        raise BadInputError(f"{what}: expected a size like '1.5GiB' or an int of bytes, got {value!r}")
    if isinstance(value, int | float):
        if value < 0:
            raise BadInputError(f"{what}: must not be negative, got {value!r}")
        return int(value)
    match = _PATTERN.match(str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise BadInputError(
            f"{what}: cannot read {value!r} as a size; write e.g. '2GiB', '512MiB', '1.5GB' or a number of bytes"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(nbytes: int | float) -> str:
    """Format a byte count with a binary unit and two decimals, e.g. ``'1.50 GiB'``."""
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{size:.0f} B" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    return f"{size:.2f} GiB"  # unreachable; keeps type checkers content

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

import math
import re

from tfmem.errors import BadInputError

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 2**10,
    "m": 10**6, "mb": 10**6, "mib": 2**20,
    "g": 10**9, "gb": 10**9, "gib": 2**30,
    "t": 10**12, "tb": 10**12, "tib": 2**40,
}
# Sizes above this are refused: more memory than any machine has (and past it TensorFlow's int64 byte counts overflow).
MAX_BYTES = 2**62
_PATTERN = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str, *, what: str = "size", minimum: int = 0) -> int:
    """Return ``value`` as an integer number of bytes.

    Accepts ints, floats, and strings such as ``"512MiB"``, ``"1.5GiB"``, ``"12GB"``, ``"800k"``, ``"1e9"``.
    Binary units (KiB, MiB, GiB, TiB) are powers of 1024; decimal ones (KB, MB, GB, TB) powers of 1000.
    A fractional number of bytes is rounded down (``1000.9`` and ``"0.0001KB"`` are 1000 and 0 bytes).

    Parameters
    ----------
    value : the size
    what : how the message names the value, e.g. ``"budget"`` or ``"--budget"``
    minimum : the smallest size accepted, after rounding down (0: any non-negative size; 1: positive)

    Raises
    ------
    BadInputError
        If the value is not a recognisable size, not finite, below ``minimum`` or above ``MAX_BYTES``
        (more memory than any machine has); the message names ``what`` and shows a valid form.

    Examples
    --------
    >>> parse_bytes(1000.9)
    1000
    >>> parse_bytes("1e400", what="--budget")
    Traceback (most recent call last):
    ...
    tfmem.errors.BadInputError: --budget: '1e400' is more than 2**62 bytes (4 EiB), more memory than any machine has; give a size such as '16GiB'
    """
    if isinstance(value, bool):
        raise BadInputError(f"{what}: expected a size like '1.5GiB' or an int of bytes, got {value!r}")
    if isinstance(value, int | float):
        if not math.isfinite(value):
            raise BadInputError(f"{what}: {value!r} is not a size; give a finite size such as '2GiB' or an int of bytes")
        size: int | float = value
    else:
        match = _PATTERN.match(str(value))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise BadInputError(
                f"{what}: cannot read {value!r} as a size; write e.g. '2GiB', '512MiB', '1.5GB' or a number of bytes"
            )
        number = match.group(1)
        size = int(number) * _UNITS[unit] if number.lstrip("+-").isdigit() else float(number) * _UNITS[unit]
    if size > MAX_BYTES:  # also infinity, e.g. '1e400'
        raise BadInputError(f"{what}: {value!r} is more than 2**62 bytes (4 EiB), more memory than any machine has; "
                            "give a size such as '16GiB'")
    if size < 0:
        raise BadInputError(f"{what}: must not be negative, got {value!r}; give a size such as '2GiB'")
    nbytes = int(size)  # rounds a fractional number of bytes down
    if nbytes < minimum:
        least = "positive" if minimum == 1 else f"at least {minimum} bytes"
        raise BadInputError(f"{what}: must be {least}, got {value!r}; give a size such as '2GiB'")
    return nbytes


def format_bytes(nbytes: int | float) -> str:
    """Format a byte count with a binary unit and two decimals, e.g. ``'1.50 GiB'``."""
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{size:.0f} B" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    return f"{size:.2f} GiB"  # unreachable; keeps type checkers content

"""Sizes in bytes, read and printed in one place, the way ``max_memory`` reads them.

:func:`parse_size` gives what accelerate's ``convert_file_size_to_int`` gives for every string accelerate
accepts (``"5GB"`` is 10**9-based, ``"5GiB"`` 2**30-based, ``"5Gb"`` and ``"5gb"`` are bits), and accepts a
little more: spaces (``"24 MB"``), ``B`` for bytes, ``TB``/``TiB``, a bare number. So a ``limit_torch_memory``
limit and a ``max_memory`` budget written the same way are the same number of bytes::

    >>> parse_size("400KB"), parse_size("1.5 GiB"), parse_size("24Mb")
    (400000, 1610612736, 3000000)
    >>> format_bytes(1536)
    '1.5 KiB'
"""

from __future__ import annotations

import math
import re
from typing import Union

from pytest_llmload.system.words import a_type

_BINARY = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_DECIMAL = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: Union[int, float, str], *, what: str = "", positive: bool = False) -> int:
    """Bytes in ``value`` (an int or float of bytes, or a string with a unit); ``ValueError`` with a sentence
    that names the value (after ``what``, e.g. ``"max_memory value"``) otherwise. ``positive`` refuses 0."""
    named = f"{what} {value!r}" if what else repr(value)
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{named} is {a_type(value)}, not a size")
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match is None:
            raise ValueError(f"{named} is not a size")
        number, unit = float(match.group(1)), match.group(2)
        if unit.upper() in _BINARY:
            nbytes = int(number * _BINARY[unit.upper()])
        elif unit.upper() in _DECIMAL:
            nbytes = int(number * _DECIMAL[unit.upper()])
            if unit.endswith("b"):  # "Gb", "gb": bits, as accelerate reads them
                nbytes //= 8
        elif unit in ("", "B"):
            nbytes = int(number)
        else:
            raise ValueError(f"{named} is not a size (unknown unit {unit!r})")
    elif not math.isfinite(value):
        raise ValueError(f"{named} is not a finite size")
    else:
        nbytes = int(value)
    if nbytes < 0:
        raise ValueError(f"{named} is negative")
    if positive and nbytes == 0:
        raise ValueError(f"{named} is not a positive size")
    return nbytes


def format_bytes(n: float) -> str:
    """``format_bytes(1536) == '1.5 KiB'``."""
    if abs(n) < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if abs(n) < 1024 or unit == "GiB":
            break
    return f"{n:.1f} {unit}"

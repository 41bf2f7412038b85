"""Byte sizes as people write them: the one type and parser of every size flag and setting.

`ByteSize("512MB")`, `--cache-limit 512MB` and `cache_limit="512MB"` mean one thing:
a letter is its SI prefix (powers of 1000) and an `i` makes it binary (powers of
1024), the rule of SI/IEC 80000-13, Kubernetes quantities (`200G` vs `200Gi`) and
Hugging Face's `max_shard_size`; disks and object stores bill in the same decimal
units. Docker and GNU tools read a bare `G` as binary: that is why the rule is stated
in every size flag's help and in docs/SHARDS.md ("Byte sizes").

    512         512 bytes          512B      512 bytes
    512K, 512KB 512,000            512Ki, 512KiB  524,288
    512M, 512MB 512,000,000        512Mi, 512MiB  536,870,912
    0.5G        500,000,000        1.5TiB    1,649,267,441,664

Units (K, M, G, T, P, E) and the `i` and `B` are read in any case. A fraction with a
unit is rounded down to a whole byte; a plain number must be whole.
"""

from __future__ import annotations

import re
from fractions import Fraction

from shards.errors import UsageError

PREFIXES = "kmgtpe"  # kilo .. exa: the power of 1000 (or of 1024 with `i`) is its index + 1
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgtpe])(i?))?(b?)", re.IGNORECASE)
SIZE_RULE = "512MB or 0.5G (powers of 1000), 512MiB or 1.5TiB (powers of 1024), or bytes"


class ByteSizeError(UsageError):
    """A text that is not a byte size; the message says how to write one."""


def parse_bytes(text: str) -> int:
    """The bytes a size names: `"512MB"` -> 512,000,000, `"512MiB"` -> 536,870,912.

    Raises:
        ByteSizeError: not a size (one line naming the text and the forms taken).
    """
    match = _SIZE.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise ByteSizeError(f"{text!r} is not a byte size; write e.g. {SIZE_RULE}")
    number, prefix, binary, _ = match.groups()
    value = Fraction(number)
    if prefix:
        base = 1024 if binary else 1000
        value *= base ** (PREFIXES.index(prefix.lower()) + 1)
    elif value.denominator != 1:
        raise ByteSizeError(f"{text!r} is not a whole number of bytes; write e.g. {SIZE_RULE}")
    return int(value)  # rounds a fraction of a byte down


class ByteSize(int):
    """A byte count, made from an int or from text as people write sizes (`parse_bytes`).

    The type of every size field, and so the parser of its flag: `ByteSize("6G")` is
    6,000,000,000 and `ByteSize(6 * 2**30)` is itself. It is an `int` everywhere else
    (JSON, arithmetic, comparisons).

    Raises:
        ByteSizeError: a negative count, a fraction of a byte, a bool, or text that is
            not a size.
    """

    def __new__(cls, value: int | float | str = 0) -> ByteSize:
        if isinstance(value, str):
            value = parse_bytes(value)
        elif isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ByteSizeError(f"{value!r} is not a byte size; write e.g. {SIZE_RULE}")
        if value < 0:
            raise ByteSizeError(f"{value!r} is not a byte size: sizes are not negative")
        return super().__new__(cls, value)

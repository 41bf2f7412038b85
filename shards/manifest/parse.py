"""Strict JSON for manifests, and the wording of what is wrong with a hostile value.

`parse_json` turns every problem of the file as a whole (not UTF-8, invalid JSON, NaN,
duplicate keys, deep nesting) into a `ManifestError`; the rest of the reader words its
problems with `wrong_value`, `show_value` and `key_path`.
"""

from __future__ import annotations

import contextlib
import gc
import json
import re
from collections.abc import Iterator
from typing import Any

from shards.manifest.errors import ManifestError
from shards.manifest.names import MAX_MANIFEST_BYTES, MAX_NAME_CHARS, PLAIN_KEY

SHA256_HEX = re.compile(r"[0-9a-f]{64}").fullmatch
MAX_COUNT = 2**63 - 1  # what an int64 holds: counts are planned with numpy
COUNT = "a non-negative integer"


class _Missing:
    """Stands for an absent key, so that a missing field fails its type check."""


class _Rejected:
    """Stands for a JSON value we refuse (NaN, Infinity, a float overflowing to inf)."""

    def __init__(self, text: str) -> None:
        self.text = text


class _DuplicateKeys(dict):
    """An object that repeated a key: it fails every `type(x) is dict` check."""

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        seen: set[str] = set()
        self.key = next(k for k, _ in pairs if k in seen or seen.add(k))


MISSING = _Missing()


def _object_from_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    return obj if len(obj) == len(pairs) else _DuplicateKeys(pairs)


def _reject_constant(text: str) -> _Rejected:
    return _Rejected(text)


def _parse_float(text: str) -> float | _Rejected:
    value = float(text)
    # 1e999 parses to inf, which `to_json` would write back as the non-JSON `Infinity`.
    return value if value - value == 0.0 else _Rejected(text)


def parse_json(text: str | bytes, source: Any) -> Any:
    """JSON to Python, with every problem of the file as a whole as a `ManifestError`."""
    if len(text) > MAX_MANIFEST_BYTES:
        raise ManifestError(source, "(file)", f"larger than {MAX_MANIFEST_BYTES} bytes")
    if isinstance(text, (bytes, bytearray, memoryview)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as error:
            raise ManifestError(
                source, "(file)", f"not UTF-8 text (byte {error.start}: {error.reason})"
            ) from error
    try:
        return json.loads(
            text,
            object_pairs_hook=_object_from_pairs,
            parse_constant=_reject_constant,
            parse_float=_parse_float,
        )
    except json.JSONDecodeError as error:
        problem = f"not valid JSON: {error.msg} at line {error.lineno} column {error.colno}"
        raise ManifestError(source, "(file)", problem) from error
    except RecursionError as error:
        problem = "nested too deeply to be a manifest (ours are a few levels deep)"
        raise ManifestError(source, "(file)", problem) from error
    except ValueError as error:  # an integer of more than 4300 digits
        raise ManifestError(source, "(file)", f"not valid JSON: {error}") from error


def show_value(value: Any) -> str:
    """A short, escaped rendering of a hostile value for an error message."""
    if isinstance(value, _Rejected):
        return value.text
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str) and len(value) > 80:
        value = value[:80]
    text = json.dumps(value)  # escapes control characters; never raises for JSON values
    return text if len(text) <= 80 else text[:77] + "..."


def wrong_value(value: Any, expected: str) -> str:
    """What is wrong with `value`, which should have been `expected`."""
    if value is MISSING:
        return f"is missing; it must be {expected}"
    if isinstance(value, _DuplicateKeys):
        return f"has the key {show_value(value.key)} more than once (duplicate keys are ambiguous)"
    if isinstance(value, _Rejected):
        return f"is {value.text}, which is not a JSON number; it must be {expected}"
    return f"must be {expected}, got {show_value(value)}"


def key_path(where: str, key: str) -> str:
    """`where.key`, or `where["odd key"]` for keys that are not plain words."""
    if not PLAIN_KEY(key):
        return f"{where}[{show_value(key)}]"
    return f"{where}.{key}" if where else key


def name_problem(name: Any, suffix: str, directory: str | None = None) -> str | None:
    """Why `name` is not a plain file name with `suffix` beside the manifest, or None.

    With `directory` (`tar/`), a plain name inside that one directory is fine too.
    """
    if type(name) is not str:
        return wrong_value(name, "a file name")
    if not name:
        return "is empty; it must be a file name"
    plain = name[len(directory) :] if directory and name.startswith(directory) else name
    if "/" in plain or "\\" in plain:
        where = "beside the manifest" + (f" or in {directory!r}" if directory else "")
        return f"{show_value(name)} is a path; it must be a plain file name {where}"
    if not plain:
        return f"{show_value(name)} is a directory; it must be a file name"
    if plain.startswith("."):
        return f"{show_value(name)} starts with '.'; hidden names and '..' are refused"
    if ":" in name:
        return f"{show_value(name)} holds ':'; URL schemes and drive letters are refused"
    if not name.isprintable():
        return f"{show_value(name)} holds control or non-printable characters"
    if len(name) > MAX_NAME_CHARS:
        return f"is {len(name)} characters long; the limit is {MAX_NAME_CHARS}"
    if not name.endswith(suffix):
        return f"{show_value(name)} does not end with {suffix!r}, the suffix of its format"
    return None


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while a manifest is parsed and checked.

    A 100k-shard manifest is about a million new dicts and lists, none of them garbage
    and none in a cycle, yet their allocation triggers hundreds of collections that
    each walk the growing tree: over half of the load time. Pausing halves it.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()

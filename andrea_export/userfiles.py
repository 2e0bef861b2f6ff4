"""Reading a file a user handed us (a TOML or JSON config, a tokenizer, an evaluation text, a manifest): a
regular file of bounded size, decoded as UTF-8, JSON of bounded depth. No such file can then exhaust memory
(`/dev/zero`), block (a FIFO) or end in a traceback (nesting deep enough for a RecursionError)."""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from pathlib import Path

KB, MB = 1 << 10, 1 << 20
MAX_CONFIG_BYTES = 1 * MB  # a model config, a build config TOML: a few hundred bytes
MAX_JSON_BYTES = 16 * MB  # a manifest, a sidecar, a sharded checkpoint's index: a few kB to a few hundred
MAX_TOKENIZER_BYTES = 64 * MB  # a tokenizer.json (ours: 0.5 MB; large vocabularies: tens of MB)
MAX_TEXT_BYTES = 64 * MB  # an evaluation text (ours: 33 kB)
MAX_JSON_DEPTH = 64  # nesting of objects and lists; ours nest 4 deep


def read_bytes(path: str | Path, limit: int, what: str, error: type[Exception]) -> bytes:
    """The bytes of `path`, a regular file of at most `limit` bytes; else `error` saying why. Opened before
    it is looked at (no window for a swap), without blocking on a FIFO."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        why = "is a directory" if e.errno == errno.EISDIR else (e.strerror or str(e)).lower()
        raise error(f"{path}: cannot read {what}: {why}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if stat.S_ISDIR(st.st_mode):
            raise error(f"{path}: is a directory, not {what}")
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{path}: not a regular file (a device, FIFO or socket); {what} must be a file")
        if st.st_size > limit:
            raise error(f"{path}: {st.st_size:,} bytes, more than {what} may have ({limit:,})")
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise error(f"{path}: cannot read {what}: {(e.strerror or str(e)).lower()}") from None
    if len(data) > limit:  # it grew while being read
        raise error(f"{path}: more than {limit:,} bytes, more than {what} may have")
    return data


def decode(data: bytes, where: str, what: str, error: type[Exception]) -> str:
    """`data` as UTF-8 (a byte-order mark dropped), whatever the locale says; else `error`."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise error(f"{where}: {what} is not UTF-8 text (byte {e.start}: {data[e.start:e.start + 1]!r})") from None


def read_text(path: str | Path, limit: int, what: str, error: type[Exception]) -> str:
    """A UTF-8 text file of at most `limit` bytes (see read_bytes)."""
    return decode(read_bytes(path, limit, what, error), str(path), what, error)


def loads_json(text: str | bytes, where: str, what: str, error: type[Exception]):
    """JSON of at most MAX_JSON_DEPTH levels (checked before parsing: deep nesting would overflow the
    parser's stack); else `error`."""
    if isinstance(text, bytes):
        text = decode(text, where, what, error)
    if _depth(text) > MAX_JSON_DEPTH:
        raise error(f"{where}: {what} nests deeper than {MAX_JSON_DEPTH} levels; not a file this tool wrote or reads")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise error(f"{where}: {what} is not valid JSON ({str(e)[:200]})") from None


def read_json(path: str | Path, limit: int, what: str, error: type[Exception]):
    """A JSON file of at most `limit` bytes and MAX_JSON_DEPTH levels."""
    return loads_json(read_text(path, limit, what, error), str(path), what, error)


def _depth(text: str) -> int:
    """The deepest nesting of [ and { outside strings, in time linear in the text."""
    depth = deepest = 0
    for ch in _BRACKETS.sub("", _STRINGS.sub("", text)):
        depth += 1 if ch in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


# A string, or an unterminated one up to the end of the text: every '"' starts a match that cannot fail, and
# the possessive quantifiers never backtrack, so each character is read once. (A pattern that can fail on an
# unterminated string is tried again from every later quote: quadratic, 15 s for 80 kB of '\"'.)
_STRINGS = re.compile(r'"(?:[^"\\]++|\\.)*+(?:"|\\?\Z)', re.S)
_BRACKETS = re.compile(r"[^\[\]{}]+")

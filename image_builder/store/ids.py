"""The one rule for ids that become file names in a store (environment names, instance
ids from catalogs and datasets): `id_problem` says why an id cannot be one, `file_name`
maps an id to its file name, `shown_id` prints an untrusted id safely in one line.
Datasets' own ids are real ids (LiveCodeBench's `codeforces/1873_A`), so `/` and other
characters are escaped (`%2F`) rather than refused; the index keeps the id itself.
"""

from __future__ import annotations

MAX_FILE_NAME = 160  # bytes: leaves room under NAME_MAX (255) for ".sqfs", "inst-", "@host@pid", temp suffixes
_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")


def file_name(ident: str) -> str:
    """The file name an id is stored under: itself when made of letters, digits and . _ -, else each other
    byte as %XX (one to one, so two ids never share a file); a leading '.' too, as gc takes those for temporaries."""
    out = "".join(c if c in _SAFE else "".join(f"%{b:02X}" for b in c.encode()) for c in ident)
    return "%2E" + out[1:] if out.startswith(".") else out


def id_problem(ident: object, max_bytes: int = MAX_FILE_NAME) -> str | None:
    """Why `ident` cannot be an environment name or instance id, or None if it can.

    `/` is allowed (file_name escapes it) but never a path that climbs or wanders: no empty, '.' or '..' part.
    Control and invisible characters are refused: they break one-line messages and logs, and NUL paths."""
    if not isinstance(ident, str) or not ident:
        return "must be a non-empty string"
    if not ident.isprintable():
        return "has a control or invisible character (NUL, newline, ...)"
    if ident != ident.strip():
        return "starts or ends with white space"
    if any(part in ("", ".", "..") for part in ident.split("/")):
        return "has an empty, '.' or '..' path part: ids may hold '/' but not climb out of a directory"
    if len(file_name(ident).encode()) > max_bytes:
        return (f"is too long: at most {max_bytes} characters as a file name "
                "(a character other than a letter, digit, '.', '_' or '-' counts 3 or more)")
    return None


def shown_id(ident: object) -> str:
    """An id for a one-line message: quoted, escaped, and cut short when long."""
    if isinstance(ident, str) and len(ident) > 80:
        return f"{ident[:60]!r}... ({len(ident)} characters)"
    return repr(ident)

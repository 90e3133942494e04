"""Writes that find no room: a full disk, an exhausted quota or a file-size limit, told apart from other I/O
errors (orbax's tensorstore writes carry the errno only in their message) and said in one sentence."""

from __future__ import annotations

import shutil

from fedpartial._src.core.errors import UserError


class OutOfSpace(UserError):
    """A result or checkpoint could not be written: the disk (or quota, or file-size limit) is full."""


#: errno values that mean "no room to write": ENOSPC, EDQUOT, EFBIG
_NO_ROOM = {28: "no space is left on the device", 122: "the disk quota is exceeded",
            27: "the file-size limit is reached"}


def out_of_space(error: BaseException) -> str | None:
    """Why ``error`` (or an exception it was raised from) is a write that found no room, or None.  Orbax's
    tensorstore writes report the errno only in their message (``[os_error_code='28']``)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in _NO_ROOM:
            return _NO_ROOM[error.errno]
        for code, reason in _NO_ROOM.items():
            if f"os_error_code='{code}'" in str(error):
                return reason
        error = error.__cause__ or error.__context__
    return None


def human_bytes(nbytes: float) -> str:
    """``nbytes`` as people read it (``215.7 KiB``)."""
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "bytes" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"


def free_bytes(path: str) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None

"""Writing a run's files so that a failed write (a full disk, a quota, a read-only remount, an I/O
error) is named, and leaves nothing half-written that a reader or a resume would take as whole.

* ``writing(what, path)``: around a write; an error of the file system, whichever library raised
  it, becomes ``WriteFailed(what, path, reason)`` (gspo.errors). The CLI turns it into one line
  with the last complete checkpoint and the resume command (gspo.training.rundir).
* ``os_error(err)``: the ``OSError`` behind an exception, also when a library wrapped it
  (safetensors reports ``... (os error 28)``; torch's zip writer a RuntimeError whose context is
  the OSError of the file object it wrote to, see ``save_torch``).
* ``append_line``: one whole line appended to a JSONL file; a write that fails part-way is cut
  back, so the file never ends in half a row.
* ``write_atomic``: a whole file or the old one (temporary file, then rename).
* ``save_torch``: ``torch.save`` through a file object of ours, so a failed write surfaces as the
  file system's OSError rather than torch's "unexpected pos".
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from pathlib import Path
from typing import Iterator

import torch

from gspo.errors import WriteFailed

_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how Rust's std::io::Error ends (safetensors)

STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EIO})
"""Errors that are the storage's, wherever they come from (not a missing file or a closed pipe)."""


def os_error(err: BaseException) -> OSError | None:
    """The file-system error behind ``err`` (itself, its cause/context, or one a library spelled
    out in its message), or None when it is not one."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError):
            return err
        found = _RUST_OS_ERROR.search(str(err))
        if found:
            code = int(found.group(1))
            return OSError(code, os.strerror(code))
        err = err.__cause__ or err.__context__
    return None


def reason(err: OSError) -> str:
    """'No space left on device (errno 28)'."""
    text = err.strerror or str(err) or type(err).__name__
    return f"{text} (errno {err.errno})" if err.errno else text


@contextlib.contextmanager
def writing(what: str, path: str | Path) -> Iterator[None]:
    """Within: a file-system error becomes ``WriteFailed`` naming ``what`` and ``path``."""
    try:
        yield
    except WriteFailed:
        raise
    except Exception as err:
        cause = os_error(err)
        if cause is None:
            raise
        raise WriteFailed(what, Path(path), reason(cause)) from err


def append_line(path: Path, line: str) -> None:
    """Append ``line`` + newline as whole bytes; on failure cut the file back to its old end."""
    data = (line + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        end = os.fstat(fd).st_size
        try:
            done = 0
            while done < len(data):   # a full disk may take part of the line, then refuse the rest
                done += os.write(fd, data[done:])
        except OSError:
            with contextlib.suppress(OSError):  # freeing never needs space; the reader copes if not
                os.ftruncate(fd, end)
            raise
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, then rename it over ``path``: a failure
    leaves the old file (or none), never half of the new one."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


class _Recording:
    """A file object for ``torch.save`` that keeps the OSError its write raised (torch reports
    only 'unexpected pos' for it)."""

    def __init__(self, fh):
        self.fh, self.error = fh, None

    def write(self, data) -> int:
        try:
            return self.fh.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.fh.flush()


def save_torch(obj, path: Path) -> None:
    """``torch.save(obj, path)``; a failed write raises the file system's OSError."""
    with open(path, "wb") as fh:
        out = _Recording(fh)
        try:
            torch.save(obj, out)
        except Exception:
            if out.error is not None:
                raise out.error from None   # (torch's own error says less)
            raise

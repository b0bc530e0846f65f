"""Secret and trust files are refused when their mode lets other users in.

Strategy. Two kinds of file carry security. A *secret* file (a node or operator signing
key, a group key, an API bearer token) is as good as the secret to anyone who reads it,
so any permission for group or others (mode & 0o077, as OpenSSH checks a private key)
refuses it. A *trust* file (a trust store, a delegation, an operator's public key) is
public, but whoever can write it decides whom this node trusts, so write permission for
group or others (mode & 0o022) refuses it; world-readable is fine. Each loader reads its
file through `read_secret_file` or `read_trust_file`, which open the file once, check the
mode of what was opened (`fstat`, so a rename in between cannot swap the file checked for
another) and read it. A refusal is a `FileModeError` (a PermissionError, so the loaders'
existing "cannot read" handling applies) naming the file, its mode and the chmod to run.
Only the mode bits are checked: not the owner, the folder, nor POSIX ACLs. What is opened
must be a regular file: a FIFO or a device is refused at once (opened without blocking),
never waited on.

A folder whose contents decide what goes out (the announcer's spool) is judged by
`refuse_open_folder`: group or others may not write it (the sticky bit does not help:
they could still add links and files), it belongs to us or root, and its parent lets
group and others write only with the sticky bit (else they could rename it away and put
their own in its place).

The project writes its own such files through `write_secret_file` (0600) and
`write_trust_file` (0644), replacing any file already there, so they always pass.
"""

from __future__ import annotations

import errno
import os
import shlex
import stat
import tempfile
from pathlib import Path

SECRET_FORBIDDEN = 0o077  # any permission for group or others
TRUST_FORBIDDEN = 0o022  # write permission for group or others
SECRET_MODE = 0o600
TRUST_MODE = 0o644


class FileModeError(PermissionError):
    """A secret or trust file whose mode lets group or others read or change it."""

    def __init__(self, path: str | Path, mode: int, message: str) -> None:
        super().__init__(errno.EACCES, message, str(path))
        self.mode = mode

    def __str__(self) -> str:
        return str(self.strerror)


def _who_can(mode: int, forbidden: int) -> str:
    """'group and others can read it', 'others can read and write it; group can execute it'."""
    said: dict[str, list[str]] = {}
    for shift, who in ((3, "group"), (0, "others")):
        bits = (mode & forbidden) >> shift & 0o7
        verbs = [verb for bit, verb in ((4, "read"), (2, "write"), (1, "execute")) if bits & bit]
        if verbs:
            said.setdefault(" and ".join(verbs), []).append(who)
    return "; ".join(f"{' and '.join(whos)} can {verbs} it" for verbs, whos in said.items())


def mode_problem(path: str | Path, mode: int, what: str, *, secret: bool) -> str | None:
    """Why a `what` file at `path` with permission bits `mode` is refused, or None when
    the mode is fine: a secret must give group and others nothing, a trust file must not
    let them write."""
    mode = stat.S_IMODE(mode)
    quoted = shlex.quote(str(path))
    if secret and mode & SECRET_FORBIDDEN:
        return (
            f"{what} {path} has mode {mode:04o}: {_who_can(mode, SECRET_FORBIDDEN)}, and it "
            f"holds a secret; make it private to its owner: chmod 600 {quoted}"
        )
    if not secret and mode & TRUST_FORBIDDEN:
        return (
            f"{what} {path} has mode {mode:04o}: {_who_can(mode, TRUST_FORBIDDEN)}, and "
            f"whoever writes it decides whom this node trusts; chmod go-w {quoted}"
        )
    return None


def refuse_open_mode(path: str | Path, mode: int, what: str, *, secret: bool) -> None:
    """Raise `FileModeError` if `mode_problem` finds one."""
    problem = mode_problem(path, mode, what, secret=secret)
    if problem is not None:
        raise FileModeError(path, stat.S_IMODE(mode), problem)


_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISLNK, "a symbolic link"),
)


def file_kind(mode: int) -> str:
    """'a FIFO', 'a folder', ... for what is not a regular file."""
    return next((name for test, name in _KINDS if test(mode)), "not a file")


def read_with_mode(path: str | Path, what: str = "file") -> tuple[bytes, int]:
    """The bytes of `path` and the mode of the file they were read from. A FIFO or
    anything else that is not a regular file is refused (`FileModeError`) without
    waiting on it. OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        if not stat.S_ISREG(mode):
            raise FileModeError(
                path, stat.S_IMODE(mode), f"{what} {path} is not a regular file ({file_kind(mode)})"
            )
        return f.read(), mode


def read_secret_file(path: str | Path, what: str) -> bytes:
    """The bytes of a secret file (`what`: "API token file", "group key file", ...),
    refused (`FileModeError`) if group or others have any permission on it. OSError."""
    data, mode = read_with_mode(path, what)
    refuse_open_mode(path, mode, what, secret=True)
    return data


def read_trust_file(path: str | Path, what: str) -> bytes:
    """The bytes of a trust file (`what`: "trust file", "delegation file", ...), refused
    (`FileModeError`) if group or others may write it. OSError."""
    data, mode = read_with_mode(path, what)
    refuse_open_mode(path, mode, what, secret=False)
    return data


def refuse_open_folder(path: str | Path, what: str) -> None:
    """Raise `FileModeError` unless the folder `path` (a `what`: "spool folder") is
    written by its owner only, that owner is us or root, and its parent lets group and
    others write only with the sticky bit. OSError when it cannot be examined."""
    folder = Path(path)
    st = os.stat(folder)
    mode, me = stat.S_IMODE(st.st_mode), os.geteuid()
    quoted = shlex.quote(str(folder))
    if not stat.S_ISDIR(st.st_mode):
        raise FileModeError(
            folder, mode, f"{what} {folder} is not a folder ({file_kind(st.st_mode)})"
        )
    if mode & TRUST_FORBIDDEN:
        raise FileModeError(
            folder,
            mode,
            f"{what} {folder} has mode {mode:04o}: {_who_can(mode, TRUST_FORBIDDEN)}, so "
            f"they could plant links and routes in it; chmod go-w {quoted}",
        )
    if st.st_uid not in (me, 0):
        raise FileModeError(
            folder,
            mode,
            f"{what} {folder} belongs to uid {st.st_uid}, not to this user ({me}) nor "
            f"root: its owner decides what is in it; use a folder of your own",
        )
    parent = folder.resolve().parent
    pst = os.stat(parent)
    pmode = stat.S_IMODE(pst.st_mode)
    if pmode & TRUST_FORBIDDEN and not pmode & stat.S_ISVTX:
        raise FileModeError(
            parent,
            pmode,
            f"folder {parent} of the {what} {folder} has mode {pmode:04o}: others can "
            f"replace the {what} ({_who_can(pmode, TRUST_FORBIDDEN)}, no sticky bit); "
            f"chmod go-w {shlex.quote(str(parent))}",
        )


def _replace_with_mode(path: str | Path, data: bytes, mode: int) -> None:
    """`data` written to a new file in `path`'s folder with exactly `mode` (whatever the
    umask), then renamed over `path`: a reader sees the old file or the whole new one,
    and a file or link already at `path` is replaced, never written through."""
    target = Path(path)
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}-")
    try:
        with os.fdopen(fd, "wb") as out:
            os.fchmod(out.fileno(), mode)
            out.write(data)
        os.replace(name, target)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise


def write_secret_file(path: str | Path, data: bytes) -> None:
    """Write a secret file mode 0600 (`read_secret_file` accepts it)."""
    _replace_with_mode(path, data, SECRET_MODE)


def write_trust_file(path: str | Path, data: bytes) -> None:
    """Write a trust file mode 0644 (`read_trust_file` accepts it)."""
    _replace_with_mode(path, data, TRUST_MODE)

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
Only the mode bits are checked: not the owner, the folder, nor POSIX ACLs.

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


def read_with_mode(path: str | Path) -> tuple[bytes, int]:
    """The bytes of `path` and the mode of the file they were read from. OSError."""
    with open(path, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        return f.read(), mode


def read_secret_file(path: str | Path, what: str) -> bytes:
    """The bytes of a secret file (`what`: "API token file", "group key file", ...),
    refused (`FileModeError`) if group or others have any permission on it. OSError."""
    data, mode = read_with_mode(path)
    refuse_open_mode(path, mode, what, secret=True)
    return data


def read_trust_file(path: str | Path, what: str) -> bytes:
    """The bytes of a trust file (`what`: "trust file", "delegation file", ...), refused
    (`FileModeError`) if group or others may write it. OSError."""
    data, mode = read_with_mode(path)
    refuse_open_mode(path, mode, what, secret=False)
    return data


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

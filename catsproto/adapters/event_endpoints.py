"""Where a modelled engine may publish its KV events: only where other users cannot read them.

Strategy. A vLLM BlockStored event carries the token ids of the prompt whose blocks it
stores, and the replay service (a ZMQ ROUTER) hands the last batches to anyone who
connects; ZMQ asks no credential. Left open, the two sockets give away what the API
token guards on /generate: other callers' prompts. So before the engine binds, each
endpoint is judged by its transport (`endpoint_problem`, pure) and an ipc folder is made
private (`private_ipc_folder`):

    inproc://NAME         this process only                        allowed
    ipc://PATH            a Unix socket: its folder decides who    allowed in a folder of
                          may connect                              mode 0700 owned by us
                                                                   (made so if missing)
    tcp://LOOPBACK:PORT   this host only (127.0.0.0/8, ::1,        allowed
                          localhost)
    anything else         whoever reaches the address              refused unless accepted

The default is neither: `PRIVATE_ENDPOINT` ("private") has the engine make a folder of
mode 0700 of its own in the temporary folder (`private_event_folder`) and publish on
``ipc://FOLDER/events`` and answer replays on ``ipc://FOLDER/replay``; the folder goes
when the engine closes. Only this user (and root) can connect there.

"Anything else" is tcp on a wildcard, a routable address, an interface or host name,
``ipc://*`` (a random name in the shared temporary folder), ``ipc://@NAME`` (Linux's
abstract namespace has no permissions) and the other transports. An operator who
protects such an endpoint otherwise (a private network, a firewall) says so with
``accept_open`` (`instance serve --accept-open-kv-events`). We do not use ZMQ CURVE,
though pyzmq has it: a subscriber written for vLLM's publisher (which has no CURVE)
could not read the events, and the keys would need a distribution of their own.
Loopback tcp, when chosen, is readable by every local user; on a shared host keep the
default.
"""

from __future__ import annotations

import ipaddress
import os
import stat
import tempfile
from pathlib import Path

__all__ = [
    "ACCEPT_OPEN_FLAG",
    "PRIVATE_ENDPOINT",
    "EndpointError",
    "check_event_endpoint",
    "endpoint_problem",
    "private_event_folder",
    "private_ipc_folder",
]

ACCEPT_OPEN_FLAG = "--accept-open-kv-events"
PRIVATE_ENDPOINT = "private"
"""An endpoint meaning: ipc in a folder of mode 0700 made for this engine."""
_WHY = "KV events carry prompt token ids and ZMQ asks no credential"


class EndpointError(ValueError):
    """A KV-event endpoint that would let others read the events."""


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def endpoint_problem(endpoint: str, *, accept_open: bool = False) -> str | None:
    """Why `endpoint` may not carry KV events, or None. An ipc endpoint passes here;
    its folder is `private_ipc_folder`'s to check; `PRIVATE_ENDPOINT` is such an ipc
    endpoint in a folder made private."""
    if endpoint.startswith("inproc://") or endpoint == PRIVATE_ENDPOINT:
        return None
    if endpoint.startswith("ipc://"):
        path = endpoint.removeprefix("ipc://")
        if path == "*" or path.startswith("@"):
            where = "the shared temporary folder" if path == "*" else "the abstract namespace"
            reach = f"{endpoint} is a socket in {where}, which any local user can reach"
        else:
            return None
    elif endpoint.startswith("tcp://"):
        # tcp://[SOURCE;]HOST:PORT: the destination decides who can listen or connect
        host = endpoint.removeprefix("tcp://").rpartition(";")[2].rpartition(":")[0]
        if _loopback(host):
            return None
        reach = f"{endpoint} is reachable beyond this host ({host or 'no address'})"
    else:
        reach = f"{endpoint} is not an inproc, ipc or loopback tcp endpoint"
    if accept_open:
        return None
    return (
        f"{reach}; {_WHY}: use ipc://FOLDER/NAME (a folder of mode 0700), a loopback tcp "
        f"address, or {ACCEPT_OPEN_FLAG} if the network is protected otherwise"
    )


def private_ipc_folder(endpoint: str, *, accept_open: bool = False) -> Path | None:
    """For ``ipc://PATH``: the socket's folder, made (mode 0700) if missing, and refused
    (`EndpointError`) unless it belongs to this user and gives group and others nothing.
    None for other endpoints. With `accept_open` an existing folder is not judged."""
    path = endpoint.removeprefix("ipc://")
    if path == endpoint or path == "*" or path.startswith("@"):
        return None
    folder = Path(os.path.abspath(path)).parent
    try:
        folder.mkdir(mode=0o700)
        os.chmod(folder, 0o700)  # whatever the umask
    except FileExistsError:
        pass
    except OSError as exc:
        raise EndpointError(
            f"{endpoint}: cannot make its folder {folder}: {exc.strerror or exc}"
        ) from None
    st = os.stat(folder)
    if not stat.S_ISDIR(st.st_mode):
        raise EndpointError(f"{endpoint}: {folder} is not a folder")
    if accept_open:
        return folder
    mode, me = stat.S_IMODE(st.st_mode), os.geteuid()
    if st.st_uid != me or mode & 0o077:
        whose = "" if st.st_uid == me else f", owned by uid {st.st_uid} (not {me})"
        raise EndpointError(
            f"{endpoint}: folder {folder} has mode {mode:04o}{whose}; {_WHY}, so the "
            "socket must sit in a folder of mode 0700 owned by the user that runs the "
            f"engine (a missing folder is made so), or give {ACCEPT_OPEN_FLAG}"
        )
    return folder


def private_event_folder() -> tuple[Path, str, str]:
    """A fresh folder of mode 0700 (`tempfile.mkdtemp`), and the KV-event and replay ipc
    endpoints in it. The caller removes the folder when its engine closes."""
    folder = Path(tempfile.mkdtemp(prefix="catsproto-kv-"))
    return folder, f"ipc://{folder}/events", f"ipc://{folder}/replay"


def check_event_endpoint(endpoint: str, *, accept_open: bool = False) -> None:
    """Refuse (`EndpointError`) an endpoint others could read KV events from; make an ipc
    endpoint's folder private first if it is missing."""
    problem = endpoint_problem(endpoint, accept_open=accept_open)
    if problem is not None:
        raise EndpointError(problem)
    private_ipc_folder(endpoint, accept_open=accept_open)

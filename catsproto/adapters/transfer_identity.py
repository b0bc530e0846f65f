"""Who may transfer: node certificates whose key is the node key, and the trust store.

Strategy: a node's transfer certificate is a self-signed X.509 certificate over its
Ed25519 node key (`transfer_certificate`), so no CA is involved; `TransferIdentity`
holds one, `PeerPolicy` says which peer keys are trusted now (a `TrustStore`, or a
`TrustFile` read again when the file changes, so a revocation holds from the next
connection on). `catsproto.adapters.transfer_tls` explains the protocol.
"""

from __future__ import annotations

import datetime
import json
import os
import ssl
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.x509.oid import NameOID

from catsproto.security import (
    Authorisation,
    KeyExpiredError,
    SigningKey,
    TrustStore,
    UnknownKeyError,
    key_id,
)
from catsproto.transfer import TransferError


class PeerAuthError(TransferError):
    """The peer is not who it must be; `reason` is one of the `REASONS`."""

    REASONS = (
        "bad-certificate",
        "unknown-key",
        "key-expired",
        "wrong-peer",
        "handshake",
        "trust-unavailable",
    )

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.code = reason

    def located(self, offset: int | None, tlv_type: int | None) -> PeerAuthError:
        return self


# ---- certificates ----------------------------------------------------------------------


def transfer_certificate(
    key: SigningKey, not_before: datetime.datetime, not_after: datetime.datetime
) -> bytes:
    """The node's self-signed Ed25519 certificate (DER): subject CN = key id in hex."""
    private = Ed25519PrivateKey.from_private_bytes(key.seed)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"catsproto {key.key_id.hex()}")])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(private.public_key())
        .serial_number(int.from_bytes(key.key_id, "big") >> 1 or 1)
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, False, False, False, False),
            critical=True,
        )
    )
    return builder.sign(private, None).public_bytes(serialization.Encoding.DER)


def certificate_key(der: bytes) -> bytes:
    """The raw Ed25519 public key of a self-signed transfer certificate (checked)."""
    try:
        cert = x509.load_der_x509_certificate(der)
        public = cert.public_key()
        if not isinstance(public, Ed25519PublicKey):
            raise PeerAuthError("bad-certificate", "not an Ed25519 key")
        public.verify(cert.signature, cert.tbs_certificate_bytes)
    except PeerAuthError:
        raise
    except Exception as exc:  # any parse or signature failure is one refusal
        raise PeerAuthError("bad-certificate", str(exc) or type(exc).__name__) from None
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


class TransferIdentity:
    """A node key with its transfer certificate, both held in memory as PEM. Python's
    `ssl` loads certificate chains from files only, so `load_into` writes them to a
    private directory (0700, key 0600) for the one `load_cert_chain` call and removes it
    at once: no private key file outlives the call, even when the process is killed."""

    def __init__(
        self,
        key: SigningKey,
        *,
        not_before: datetime.datetime | None = None,
        not_after: datetime.datetime | None = None,
    ) -> None:
        now = datetime.datetime.now(datetime.UTC)
        self.key = key
        self.certificate = transfer_certificate(
            key,
            not_before or now - datetime.timedelta(hours=1),
            not_after or now + datetime.timedelta(days=1),
        )
        self._cert_pem = ssl.DER_cert_to_PEM_cert(self.certificate).encode()
        self._key_pem = Ed25519PrivateKey.from_private_bytes(key.seed).private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    def load_into(self, ctx: ssl.SSLContext) -> None:
        """`ctx.load_cert_chain` with this certificate and key."""
        with tempfile.TemporaryDirectory(prefix="catsproto-xfer-") as folder:
            os.chmod(folder, 0o700)
            cert_file, key_file = Path(folder) / "cert.pem", Path(folder) / "key.pem"
            cert_file.write_bytes(self._cert_pem)
            fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(self._key_pem)
            ctx.load_cert_chain(cert_file, key_file)

    @property
    def key_id(self) -> bytes:
        return self.key.key_id

    def close(self) -> None:
        """Nothing is left to remove (kept so callers can close identities alike)."""

    def __enter__(self) -> TransferIdentity:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class TrustFile:
    """A trust file read again whenever it changes, so a holder that runs for days
    refuses a key revoked (or a delegation removed) in the file from the next connection
    on (issue #32, row 3), as the BGP receiver's `TrustFileVerifier` does.

    `current()` compares the file's stat stamp (mtime, size, inode) with the one last
    read and reads the file only when it differs. Fail-closed: until the file has loaded
    once, `current()` is None and every peer is refused (`trust-unavailable`); after
    that, a file that goes missing, cannot be read or does not load leaves the last good
    store in force, and the failure is logged once per state of the file and counted in
    `reload_failures`. Safe to call from every connection's thread. `read` reads the
    file's bytes (a reader that also checks the file's mode plugs in here; an `OSError`
    it raises is a failed load)."""

    def __init__(
        self,
        path: str | Path,
        *,
        log: Callable[[str], None] = _stderr,
        read: Callable[[Path], bytes] = Path.read_bytes,
    ) -> None:
        self.path = Path(path)
        self.log = log
        self.read = read
        self.loads = 0
        self.reload_failures = 0
        self.error = "not read yet"
        self._stamp: tuple[int, ...] | None = None  # the file state last read, or tried
        self._store: TrustStore | None = None  # the last good load
        self._lock = threading.Lock()

    def current(self) -> TrustStore | None:
        """The trust store of the file as it is now, or the last good one; None before
        the first good load."""
        with self._lock:
            try:
                st = self.path.stat()
            except OSError as exc:
                self._failed((-1,), f"cannot read it: {exc.strerror or exc}")
                return self._store
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino, st.st_mode)  # a chmod too
            if stamp == self._stamp:
                return self._store
            try:
                store = TrustStore.from_json(json.loads(self.read(self.path)))
            except OSError as exc:
                self._failed(stamp, f"cannot read it: {exc.strerror or exc}")
            except (ValueError, RecursionError) as exc:  # JSON, UTF-8, TrustFileError
                self._failed(stamp, f"does not load: {exc}")
            else:
                if self.loads:
                    self.log(f"trust file {self.path}: reloaded")
                self._stamp, self._store, self.error = stamp, store, ""
                self.loads += 1
            return self._store

    def _failed(self, stamp: tuple[int, ...], error: str) -> None:
        """Count and log a failed (re)load once per state of the file."""
        if stamp == self._stamp:
            return
        self._stamp, self.error = stamp, error
        self.reload_failures += 1
        kept = "keeping the last good trust store" if self._store else "refusing every peer"
        self.log(f"trust file {self.path}: {error}; {kept}")


@dataclass
class PeerPolicy:
    """Which peers to accept: a trust-store delegation valid at `clock_ms()`, and, when
    `expected_key_id` is set, exactly that node. `trust` is a store, or a `TrustFile`
    whose current store is looked up at every check."""

    trust: TrustStore | TrustFile
    expected_key_id: bytes | None = None
    clock_ms: Callable[[], int] = wall_clock_ms

    def store(self) -> TrustStore:
        """The trust store in force now; `PeerAuthError` (trust-unavailable) if none."""
        if isinstance(self.trust, TrustStore):
            return self.trust
        store = self.trust.current()
        if store is None:
            raise PeerAuthError(
                "trust-unavailable", f"trust file {self.trust.path}: {self.trust.error}"
            )
        return store

    def check(self, certificate: bytes) -> Authorisation:
        trust = self.store()
        raw = certificate_key(certificate)
        kid = key_id(raw)
        if self.expected_key_id is not None and kid != self.expected_key_id:
            raise PeerAuthError(
                "wrong-peer", f"key {kid.hex()}, expected {self.expected_key_id.hex()}"
            )
        auth = trust.lookup(kid)
        if auth is None or auth.node.raw != raw:
            raise PeerAuthError("unknown-key", f"no delegation for key {kid.hex()}")
        try:
            auth.check_validity(self.clock_ms())
        except KeyExpiredError as exc:
            raise PeerAuthError("key-expired", str(exc)) from None
        except UnknownKeyError as exc:  # pragma: no cover - lookup already answered
            raise PeerAuthError("unknown-key", str(exc)) from None
        return auth

"""The receive path: attribute bytes and their route in, a `Verdict` out.

Strategy: `check` is a pure function of (bytes, route, now, trust store, replay window,
policy, group keys) and returns a `Verdict`; it changes nothing. `Receiver.receive` is
`check` plus the commit: it returns the verdict and the next receiver, whose trust store
and replay window are the very same objects unless the advertisement was accepted (only
the counters move on a refusal). Checks run cheapest first and the first that fails
names the reason:

 1. decode (malformed)               6. timestamp within [now - max_age, now + max_future]
 2. signature TLV present (unsigned) 7. (epoch, sequence) not below the last accepted on
 3. signer's key: trust store or a      the route, epoch not below the origin's (replayed)
    carried delegation (unknown-key, 8. Ed25519 over `signing.signed_message` (bad-signature)
    bad-delegation)                  9. same (epoch, sequence): duplicate or equivocation
 4. delegation valid now (expired)  10. open the sealed cache section when group keys are
 5. CS-ID, instance address, site       given and one of them is its key (decryption-failed)
    and route in its scope
    (not-authorised)

Without group keys a sealed advertisement is still verified and accepted, cache section
unread (that is what an unauthorised selector can do). Two more cases are that same case
whatever keys are held: a section sealed with an AEAD algorithm this code does not
implement, and one sealed under a group key id the receiver does not hold (an origin that
moved to the next key before this receiver got it: refusing would take the instance out
of selection for the length of a botched rollover). Each is accepted, the section
unopened, the rest used; the verdict names the algorithm (`unknown_algorithm`) or the key
id (`unheld_group_key`), in its detail too, and the counters tally each. The signature
covers the sealed octets as they are, so it verifies all the same. A key that is held but
does not authenticate the section is still refused (decryption-failed): that is damage or
a forgery by a signer without the group key, not a rollover.

Step 8 is most of the cost. `presign` does it alone, from the bytes, the route and the
trust store (no replay window, no clock), so that other processes can do it ahead of a
receiver that takes values in order: their answer (`Presigned`) is handed to `check`,
which uses it only where it resolved the same key for the same signature, and verifies
itself otherwise. Every verdict is the one `check` gives without it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from catsproto import wire
from catsproto.security.errors import (
    ERROR_FOR_REASON,
    BadDelegationError,
    BadSignatureError,
    DuplicateError,
    EquivocationError,
    FutureTimestampError,
    MalformedError,
    Reason,
    ReplayedError,
    StaleTimestampError,
    UnknownKeyError,
    UnsignedError,
)
from catsproto.security.identity import key_id
from catsproto.security.replay import ReplayWindow, RouteKey, RouteState, route_key
from catsproto.security.sealing import GroupKeyring, open_sealed, unknown_algorithm
from catsproto.security.signing import (
    ADVERTISEMENT_LABEL,
    IPNetwork,
    nlri_bytes,
    signature_span,
)
from catsproto.security.trust import Authorisation, TrustStore
from catsproto.wire import Advertisement, CodecError, Delegation
from catsproto.wire.compiled import filling_class

DEFAULT_MAX_AGE_MS = 120_000
DEFAULT_MAX_FUTURE_MS = 5_000
_REASONS = tuple(Reason)
_INDEX = {r: i for i, r in enumerate(_REASONS)}


@dataclasses.dataclass(frozen=True, slots=True)
class Policy:
    """Freshness rules. An origin must re-advertise (a new sequence) well within
    `max_age_ms`, or selectors drop its routes' cache state as stale."""

    max_age_ms: int = DEFAULT_MAX_AGE_MS
    max_future_ms: int = DEFAULT_MAX_FUTURE_MS
    attribute_type: int = wire.DEFAULT_ATTRIBUTE_TYPE
    # label and attribute type: the constant start of every signed message
    _message_head: bytes = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0 <= self.attribute_type <= 255:
            raise ValueError(f"attribute type {self.attribute_type} outside 0..255")
        head = ADVERTISEMENT_LABEL + bytes((self.attribute_type,))
        object.__setattr__(self, "_message_head", head)


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome for one advertisement on one route.

    advertisement: the verified advertisement, cache section opened when group keys
    were given (for ok and duplicate; None otherwise). state: what the replay window
    records when it is accepted. learned: a carried delegation checked on the way,
    which the trust store takes on when the advertisement is accepted.
    unknown_algorithm: the code of the sealing algorithm when the advertisement was
    accepted with its sealed section unopened because this code has no such AEAD.
    unheld_group_key: the group key id when it was accepted with its sealed section
    unopened because the receiver holds group keys but not that one.
    """

    reason: Reason
    detail: str
    route: RouteKey | None = None
    advertisement: Advertisement | None = None
    signer: Authorisation | None = None
    state: RouteState | None = None
    learned: Authorisation | None = None
    error: CodecError | None = None
    unknown_algorithm: int | None = None
    unheld_group_key: int | None = None

    @property
    def ok(self) -> bool:
        return self.reason is Reason.OK

    def raise_if_refused(self) -> Advertisement:
        """The advertisement if accepted; else raise the error of the reason."""
        if self.ok and self.advertisement is not None:
            return self.advertisement
        if self.error is not None:
            raise self.error
        raise ERROR_FOR_REASON[self.reason](self.detail)

    def to_json(self) -> wire.fields.JSON:
        out: dict[str, wire.fields.JSON] = {"reason": self.reason.value, "detail": self.detail}
        if self.route is not None:
            out["route"] = {
                "cs_id": self.route.cs_id,
                "address": str(self.route.address),
                "nlri": str(self.route.nlri),
            }
        if self.signer is not None:
            out["key_id"] = self.signer.key_id.hex()
            out["operator"] = self.signer.operator.name
        if self.state is not None:
            out["epoch"], out["sequence"] = self.state.position
        if self.unknown_algorithm is not None:
            out["unknown_sealing_algorithm"] = self.unknown_algorithm
        if self.unheld_group_key is not None:
            out["unheld_group_key"] = self.unheld_group_key
        return out


def _signature_and_delegation(
    adv: Advertisement,
) -> tuple[wire.Signature | None, Delegation | None]:
    """The signature and carried delegation TLVs. Types strictly increase, so when the
    last TLV is the signature (255) a delegation (254) can only be the one before it."""
    tlvs = adv.tlvs
    if type(tlvs[-1]) is wire.Signature:
        before = tlvs[-2] if len(tlvs) > 1 else None
        return tlvs[-1], before if type(before) is Delegation else None
    return adv.signature, adv.get(Delegation)


def _signer(
    carried: Delegation | None, signature: wire.Signature, trust: TrustStore
) -> tuple[Authorisation, Authorisation | None]:
    """The authorisation of the signing key, and whether it was newly learned."""
    known = trust.lookup(signature.key_id)
    if carried is None or (known is not None and known.delegation == carried):
        if known is None:
            why = "is revoked" if signature.key_id in trust.revoked else "is not authorised"
            raise UnknownKeyError(f"signing key {signature.key_id.hex()} {why}")
        return known, None
    if key_id(carried.node_key) != signature.key_id:
        raise BadDelegationError(
            f"carried delegation is for key {key_id(carried.node_key).hex()}, "
            f"the signature by key {signature.key_id.hex()}",
            tlv_type=wire.TLVType.DELEGATION,
        )
    learned = trust.check_delegation(carried)
    return learned, learned


def _signature_span(value: bytes, adv: Advertisement, signature: wire.Signature) -> tuple[int, int]:
    """Where the signature TLV sits in `value`: the value is canonical, so when the
    signature is the last TLV (no unknown type above 255 follows) it is the last
    4 + 2 + len(key_id) + len(signature) bytes; otherwise walk the TLV headers."""
    if adv.tlvs[-1] is signature:
        end = len(value)
        return end - 6 - len(signature.key_id) - len(signature.signature), end
    return signature_span(value)


@dataclasses.dataclass(frozen=True, slots=True)
class Presigned:
    """Step 8 done ahead: whether `signature` by the Ed25519 key `key` (raw, 32 bytes)
    verifies over the signed message of one value on one route. Only ever valid for that
    value and route: `check` trusts `ok` where its own key and signature are these."""

    key: bytes
    signature: bytes
    ok: bool


def presign(
    value: bytes, nlri: IPNetwork, trust: TrustStore, policy: Policy = Policy()
) -> Presigned | None:
    """The Ed25519 check of `value` on `nlri` alone, the key found in `trust` or in the
    value's carried delegation; None where there is nothing to check or no key to check
    it with (a receiver then finds why itself). Pure, like `check`; never raises for bad
    input."""
    try:
        adv = wire.decode(value)
        signature, carried = _signature_and_delegation(adv)
        if signature is None:
            return None
        auth, _ = _signer(carried, signature, trust)
    except (CodecError, ValueError):  # the verification errors are CodecErrors
        return None
    start, stop = _signature_span(value, adv, signature)
    view = memoryview(value)
    message = b"".join((policy._message_head, nlri_bytes(nlri), view[:start], view[stop:]))
    ok = auth.node.verify(signature.signature, message)
    return Presigned(auth.node.raw, signature.signature, ok)


def _verify(
    value: bytes,
    nlri: IPNetwork,
    now_ms: int,
    trust: TrustStore,
    window: ReplayWindow,
    policy: Policy,
    group_keys: GroupKeyring | None,
    decoded: Advertisement | None = None,
    presigned: Presigned | None = None,
) -> Verdict:
    if decoded is not None:
        adv = decoded
    else:
        try:
            adv = wire.decode(value)
        except CodecError as exc:
            raise MalformedError(exc.reason, exc.offset, exc.tlv_type) from None
    tlvs = adv.tlvs
    # decode guarantees the mandatory Version, Origin, Sequence and Timestamp (types 1-4),
    # in that order; they are the first four unless an unknown type 0 comes first
    if type(tlvs[1]) is wire.Origin:
        origin, seq, ts = tlvs[1], tlvs[2], tlvs[3].ms
    else:
        origin, seq, ts = adv.origin, adv.sequence, adv.timestamp_ms
    route = route_key(origin.cs_id, origin.address, nlri)
    try:
        signature, carried = _signature_and_delegation(adv)
        if signature is None:
            raise UnsignedError("advertisement carries no signature TLV")
        auth, learned = _signer(carried, signature, trust)
        auth.check_validity(now_ms)
        auth.check_scope(origin.cs_id, origin.address, nlri, origin.site_id)
        if ts < now_ms - policy.max_age_ms:
            raise StaleTimestampError(
                f"timestamp {ts} is {now_ms - ts} ms old, more than {policy.max_age_ms}"
            )
        if ts > now_ms + policy.max_future_ms:
            raise FutureTimestampError(
                f"timestamp {ts} is {ts - now_ms} ms ahead, more than {policy.max_future_ms}"
            )
        position = (seq.epoch, seq.sequence)
        previous = window.get(route)
        if previous is not None and position < previous.position:
            raise ReplayedError(
                f"(epoch, sequence) {position} is below the last accepted {previous.position}"
            )
        origin_epoch = window.origin_epoch(route)
        if origin_epoch is not None and seq.epoch < origin_epoch:
            # a copy from before the origin's restart, late on another path or left
            # announced by the crashed process: its cache is gone (draft, Replay)
            raise ReplayedError(
                f"epoch {seq.epoch} is below epoch {origin_epoch}, which origin "
                f"{origin.address} has advertised since"
            )
        # signing.received_message, with the label and type from the policy
        start, stop = _signature_span(value, adv, signature)
        view = memoryview(value)
        message = b"".join((policy._message_head, nlri_bytes(nlri), view[:start], view[stop:]))
        if (
            presigned is not None
            and presigned.key == auth.node.raw
            and presigned.signature == signature.signature
        ):
            verified = presigned.ok  # done ahead, for this value, route and key
        else:
            verified = auth.node.verify(signature.signature, message)
        if not verified:
            raise BadSignatureError(
                f"Ed25519 signature by key {signature.key_id.hex()} does not verify "
                f"for route {nlri}",
                tlv_type=wire.TLVType.SIGNATURE,
            )
        if previous is not None and position == previous.position:
            if previous.signature != signature.signature:
                raise EquivocationError(
                    f"(epoch, sequence) {position} was accepted before with other content"
                )
            duplicate = True
        else:
            duplicate = False
        # an AEAD this code lacks, or a key id not held (a rollover this receiver has not
        # caught up with): unopened as without group keys, and accepted (the sender's
        # metrics must reach a receiver older than its algorithm or its key)
        unknown = unknown_algorithm(adv)
        unheld = None
        if group_keys is not None and unknown is None:
            sealed = adv.get(wire.SealedCache)
            if sealed is not None and group_keys.get(sealed.key_id) is None:
                unheld = sealed.key_id
            else:
                adv = open_sealed(adv, group_keys)
    except BadSignatureError as exc:
        return Verdict(exc.why, str(exc), route, error=exc)
    if unknown is not None or unheld is not None:
        if unknown is not None:
            detail = f"sealed cache section not opened: unknown sealing algorithm {unknown}"
        else:
            detail = f"sealed cache section not opened: group key {unheld} is not held"
        if duplicate:
            return Verdict(
                Reason.DUPLICATE,
                f"{position} already accepted; {detail}",
                route,
                adv,
                auth,
                unknown_algorithm=unknown,
                unheld_group_key=unheld,
            )
        verdict = _accepted(route, adv, auth, seq, ts, signature.signature, learned)
        return dataclasses.replace(
            verdict,
            detail=f"accepted; {detail}",
            unknown_algorithm=unknown,
            unheld_group_key=unheld,
        )
    if duplicate:
        return Verdict(Reason.DUPLICATE, f"{position} already accepted", route, adv, auth)
    return _accepted(route, adv, auth, seq, ts, signature.signature, learned)


# Every accepted advertisement makes a RouteState and a Verdict whose fields are known
# good; filling them as their slot-compatible twins costs a third of the dataclass
# __init__ (`wire.compiled.filling_class`).
_new = object.__new__
_STATE_FILL = filling_class(RouteState)
_VERDICT_FILL = filling_class(Verdict)
assert _STATE_FILL is not None and _VERDICT_FILL is not None


def _accepted(
    route: RouteKey,
    adv: Advertisement,
    auth: Authorisation,
    seq: wire.Sequence,
    timestamp_ms: int,
    signature: bytes,
    learned: Authorisation | None,
) -> Verdict:
    """`Verdict(OK, "accepted", route, adv, auth, RouteState(...), learned)`."""
    state = _new(_STATE_FILL)
    state.epoch = seq.epoch
    state.sequence = seq.sequence
    state.timestamp_ms = timestamp_ms
    state.signature = signature
    state.__class__ = RouteState
    verdict = _new(_VERDICT_FILL)
    verdict.reason = Reason.OK
    verdict.detail = "accepted"
    verdict.route = route
    verdict.advertisement = adv
    verdict.signer = auth
    verdict.state = state
    verdict.learned = learned
    verdict.error = None
    verdict.unknown_algorithm = None
    verdict.unheld_group_key = None
    verdict.__class__ = Verdict
    return verdict


def check(
    value: bytes | Advertisement,
    nlri: IPNetwork,
    now_ms: int,
    trust: TrustStore,
    window: ReplayWindow = ReplayWindow(),  # noqa: B008  # immutable
    policy: Policy = Policy(),  # immutable
    group_keys: GroupKeyring | None = None,
    decoded: Advertisement | None = None,
    presigned: Presigned | None = None,
) -> Verdict:
    """Verify one received advertisement for its route; never raises for bad input.

    `decoded`: `wire.decode(value)` when the caller has already decoded the value (a
    daemon that decodes first to answer malformed attributes as RFC 7606 says); it is
    then not decoded twice. `presigned`: `presign` of this same value and route, done
    ahead (by a pool of processes); used where it names the key and signature this
    check resolves. Passing either for other bytes is the caller's bug."""
    if isinstance(value, Advertisement):
        value = wire.encode(value)
    try:
        return _verify(
            bytes(value), nlri, now_ms, trust, window, policy, group_keys, decoded, presigned
        )
    except BadSignatureError as exc:
        return Verdict(exc.why, str(exc), error=exc)


def verify_advertisement(
    value: bytes | Advertisement,
    nlri: IPNetwork,
    now_ms: int,
    trust: TrustStore,
    window: ReplayWindow = ReplayWindow(),  # noqa: B008  # immutable
    policy: Policy = Policy(),  # immutable
    group_keys: GroupKeyring | None = None,
) -> Advertisement:
    """One-shot form of `check`: the verified advertisement, or a BadSignatureError."""
    verdict = check(value, nlri, now_ms, trust, window, policy, group_keys)
    if verdict.reason is Reason.DUPLICATE:
        raise DuplicateError(verdict.detail)
    return verdict.raise_if_refused()


@dataclasses.dataclass(frozen=True, slots=True)
class Counters:
    """How many advertisements ended with each reason (an immutable tally), and how many
    of those accepted had their sealed section left unopened for an unknown algorithm or
    for a group key not held."""

    counts: tuple[int, ...] = (0,) * len(_REASONS)
    unknown_algorithm: int = 0
    unheld_group_key: int = 0

    def record(
        self, reason: Reason, unknown_algorithm: bool = False, unheld_group_key: bool = False
    ) -> Counters:
        counts = list(self.counts)
        counts[_INDEX[reason]] += 1
        out = _new(_COUNTERS_FILL)
        out.counts = tuple(counts)
        out.unknown_algorithm = self.unknown_algorithm + unknown_algorithm
        out.unheld_group_key = self.unheld_group_key + unheld_group_key
        out.__class__ = Counters
        return out

    def __getitem__(self, reason: Reason) -> int:
        return self.counts[_INDEX[reason]]

    def as_dict(self) -> Mapping[str, int]:
        return {r.value: n for r, n in zip(_REASONS, self.counts, strict=True)}

    @property
    def refused(self) -> int:
        return sum(self.counts) - self[Reason.OK] - self[Reason.DUPLICATE]


@dataclasses.dataclass(frozen=True, slots=True)
class Receiver:
    """A selector's verification state: trust, replay window, policy, keys, counters."""

    trust: TrustStore
    window: ReplayWindow = ReplayWindow()  # noqa: RUF009  # immutable
    policy: Policy = Policy()  # immutable
    group_keys: GroupKeyring | None = None
    counters: Counters = Counters()  # immutable

    def check(self, value: bytes | Advertisement, nlri: IPNetwork, now_ms: int) -> Verdict:
        return check(value, nlri, now_ms, self.trust, self.window, self.policy, self.group_keys)

    def commit(self, verdict: Verdict) -> Receiver:
        """The receiver after `verdict`: counted; window and trust move only on OK."""
        counters = self.counters.record(
            verdict.reason,
            verdict.unknown_algorithm is not None,
            verdict.unheld_group_key is not None,
        )
        if verdict.reason is not Reason.OK:
            return _receiver(self.trust, self.window, self.policy, self.group_keys, counters)
        assert verdict.route is not None and verdict.state is not None
        trust = self.trust
        if verdict.learned is not None:
            trust = trust.with_authorisation(verdict.learned)
        window = self.window.with_entry(verdict.route, verdict.state)
        return _receiver(trust, window, self.policy, self.group_keys, counters)

    def receive(
        self,
        value: bytes | Advertisement,
        nlri: IPNetwork,
        now_ms: int,
        decoded: Advertisement | None = None,
        presigned: Presigned | None = None,
    ) -> tuple[Verdict, Receiver]:
        """`check` then `commit`; `decoded` and `presigned` as `check` takes them."""
        verdict = check(
            value,
            nlri,
            now_ms,
            self.trust,
            self.window,
            self.policy,
            self.group_keys,
            decoded,
            presigned,
        )
        return verdict, self.commit(verdict)

    def reloaded(self, trust: TrustStore, loaded: TrustStore) -> Receiver:
        """This receiver with a trust store read anew (`loaded` is the one it was built
        from). The replay window, policy, group keys and counters carry over, so a
        trust-file edit cannot re-admit an old (epoch, sequence); delegations learned
        in-band are checked again against the new operators and kept if they pass.

        Revocation carries over too: a key revoked before, or whose delegation the old
        file held and the new one does not, stays revoked, so the node cannot bring it
        back in-band. Only a delegation in the new file itself authorises it again."""
        removed = loaded.authorisations.keys() - trust.authorisations.keys()
        trust = trust.without_keys((self.trust.revoked | removed) - trust.authorisations.keys())
        for k, auth in self.trust.authorisations.items():
            before = loaded.authorisations.get(k)
            if before is not None and before.delegation == auth.delegation:
                continue  # it came from the old file: the new file says what holds now
            try:
                trust = trust.with_delegation(auth.delegation)
            except (UnknownKeyError, BadDelegationError):
                continue  # its operator is gone, or the new file holds a later one
        return Receiver(trust, self.window, self.policy, self.group_keys, self.counters)

    def expire(self, now_ms: int) -> Receiver:
        """Forget routes whose last accepted advertisement is past the freshness window."""
        window = self.window.expire(now_ms, self.policy.max_age_ms)
        return Receiver(self.trust, window, self.policy, self.group_keys, self.counters)


_RECEIVER_FILL = filling_class(Receiver)
_COUNTERS_FILL = filling_class(Counters)
assert _RECEIVER_FILL is not None and _COUNTERS_FILL is not None


def _receiver(
    trust: TrustStore,
    window: ReplayWindow,
    policy: Policy,
    group_keys: GroupKeyring | None,
    counters: Counters,
) -> Receiver:
    """`Receiver(...)` from parts that are already valid (one per advertisement)."""
    out = _new(_RECEIVER_FILL)
    out.trust = trust
    out.window = window
    out.policy = policy
    out.group_keys = group_keys
    out.counters = counters
    out.__class__ = Receiver
    return out

"""Operator keys, the node keys they authorise, and the trust file.

Strategy: trust has two levels and nothing else. A receiver is configured with operator
public keys. An operator signs a *delegation* (the `wire.Delegation` TLV: node key,
validity period, scope) saying that one node key may speak for some CS-IDs, on some
route prefixes, from some instance addresses and, when it lists sites, for those sites
only (the Origin's site id prices the instance at a selector, so a node must not claim
another site's). A delegation reaches a receiver either in
its trust file or inside an advertisement (then it is checked on first use and
remembered only if that advertisement is accepted). Either way the operator's signature
is checked once, and the result is an `Authorisation`: the parsed node key and its scope
as sets, so checking an advertisement costs set lookups and one Ed25519 verify.

The operator signature covers::

    "catsproto/v1 delegation" 0x00   label (24 bytes)
    the Delegation TLV value with the operator_signature field left out
    (algorithm, operator_key_id, node_key, not_before_ms, not_after_ms, scope)

A delegation without SITE entries authorises every site (delegations made before the
SITE kind existed stay valid); one with SITE entries authorises only those, and an
Origin naming another site is refused as not-authorised (draft, Delegation TLV).

A store holds one delegation per node key: the one with the latest `not_before_ms`,
so a renewal replaces the old delegation and an old, wider one cannot be played back.
Revoking a key puts its id in the store's revoked set: a delegation is still valid
until it expires, so without that set the node could carry it in-band and be learned
again. An operator may have a scope (CS-IDs, routes, addresses, optionally sites);
every delegation it signs must lie within it, so with several operators one cannot speak
for another's instances (nor, when its scope lists sites, claim another's site: its
delegations must then list sites, all of them its own). An operator without a scope may
delegate anything (one-operator setups). The trust file is JSON (format
"catsproto-trust/1"; see docs/security-reference.md).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
from collections.abc import Iterable, Mapping
from types import MappingProxyType

from catsproto.security.errors import (
    BadDelegationError,
    KeyExpiredError,
    NotAuthorisedError,
    UnknownKeyError,
)
from catsproto.security.identity import (
    KEY_ID_LEN,
    KeyFormatError,
    PublicKey,
    SigningKey,
    key_id,
)
from catsproto.security.signing import IPNetwork
from catsproto.wire import (
    CodecError,
    Delegation,
    ScopeEntry,
    ScopeKind,
    SignatureAlgorithm,
    Writer,
)
from catsproto.wire.fields import JSON, IPAddress

DELEGATION_LABEL = b"catsproto/v1 delegation\x00"
TRUST_FORMAT = "catsproto-trust/1"
DELEGATION_FORMAT = "catsproto-delegation/1"


class TrustFileError(ValueError):
    """A trust file, key or delegation file that cannot be loaded; says what and where."""


def delegation_message(d: Delegation) -> bytes:
    """The bytes the operator signs: the label, then every field but the signature."""
    w = Writer()
    for name, codec in type(d)._LAYOUT:
        if name != "operator_signature":
            codec.write(w, getattr(d, name))
    return DELEGATION_LABEL + w.getvalue()


def _networks(items: Iterable[IPNetwork | str]) -> list[IPNetwork]:
    return [ipaddress.ip_network(x) if isinstance(x, str) else x for x in items]


def authorise(
    operator: SigningKey,
    node_key: bytes,
    *,
    cs_ids: Iterable[int],
    routes: Iterable[IPNetwork | str],
    addresses: Iterable[IPNetwork | str],
    not_before_ms: int,
    not_after_ms: int,
    sites: Iterable[int] = (),
) -> Delegation:
    """The operator's signed delegation of `node_key` (raw Ed25519 public key). `sites`:
    the site ids the node's Origin may name; none authorises every site."""
    scope = [ScopeEntry.for_cs_id(c) for c in cs_ids]
    scope += [ScopeEntry.for_network(ScopeKind.ROUTE, n) for n in _networks(routes)]
    scope += [ScopeEntry.for_network(ScopeKind.ADDRESS, n) for n in _networks(addresses)]
    scope += [ScopeEntry.for_site(s) for s in sites]
    unsigned = Delegation(
        algorithm=SignatureAlgorithm.ED25519,
        operator_key_id=operator.key_id,
        node_key=bytes(node_key),
        not_before_ms=not_before_ms,
        not_after_ms=not_after_ms,
        operator_signature=bytes(64),
        scope=tuple(sorted(set(scope), key=ScopeEntry.key)),
    )
    signature = operator.sign(delegation_message(unsigned))
    return dataclasses.replace(unsigned, operator_signature=signature)


# A scope network as integers: (IP version, network address, netmask, prefix length).
_IntNetwork = tuple[int, int, int, int]


def _as_ints(n: IPNetwork) -> _IntNetwork:
    return (n.version, int(n.network_address), int(n.netmask), n.prefixlen)


def _address_within(address: IPAddress, networks: tuple[_IntNetwork, ...]) -> bool:
    """`address in n` for some n (integer compares; ipaddress's are ~10x slower)."""
    version, value = address.version, int(address)
    for v, net, mask, _ in networks:  # noqa: SIM110  # a loop: no generator frame per call
        if v == version and value & mask == net:
            return True
    return False


def _network_within(nlri: IPNetwork, networks: tuple[_IntNetwork, ...]) -> bool:
    """`nlri.subnet_of(n)` for some n of the same version."""
    version, value, length = nlri.version, int(nlri.network_address), nlri.prefixlen
    for v, net, mask, plen in networks:
        if v == version and length >= plen and value & mask == net:
            return True
    return False


@dataclasses.dataclass(frozen=True, slots=True)
class OperatorScope:
    """What an operator may delegate: every CS-ID of a delegation it signs must be one of
    `cs_ids`, every route and address network must lie inside one of `routes` and
    `addresses` (a delegation's scope entries, the same kinds). `sites`: None lets the
    operator delegate any site; a set requires every delegation it signs to list sites,
    all of them in the set (a delegation without sites would authorise every site)."""

    cs_ids: frozenset[int]
    routes: tuple[IPNetwork, ...]
    addresses: tuple[IPNetwork, ...]
    sites: frozenset[int] | None = None

    @classmethod
    def of(
        cls,
        *,
        cs_ids: Iterable[int],
        routes: Iterable[IPNetwork | str],
        addresses: Iterable[IPNetwork | str],
        sites: Iterable[int] | None = None,
    ) -> OperatorScope:
        scope = cls(
            frozenset(cs_ids),
            tuple(_networks(routes)),
            tuple(_networks(addresses)),
            None if sites is None else frozenset(sites),
        )
        for name in ("cs_ids", "routes", "addresses", "sites"):
            if getattr(scope, name) is not None and not getattr(scope, name):
                raise ValueError(f"operator scope: {name} is empty (it would allow nothing)")
        return scope

    def outside(self, delegation: Delegation) -> str | None:
        """The first scope entry of `delegation` outside this scope, shown, or None."""
        for e in delegation.entries(ScopeKind.CS_ID):
            if e.cs_id not in self.cs_ids:
                return f"CS-ID {e.cs_id}"
        if self.sites is not None:
            sites = delegation.entries(ScopeKind.SITE)
            if not sites:
                return "every site (the delegation lists none)"
            for e in sites:
                if e.site_id not in self.sites:
                    return f"site {e.site_id}"
        for kind, allowed, what in (
            (ScopeKind.ROUTE, self.routes, "route"),
            (ScopeKind.ADDRESS, self.addresses, "address"),
        ):
            networks = tuple(_as_ints(n) for n in allowed)
            for e in delegation.entries(kind):
                if not _network_within(e.network, networks):
                    return f"{what} {e.network}"
        return None

    def to_json(self) -> JSON:
        out: dict[str, JSON] = {
            "cs_ids": sorted(self.cs_ids),
            "routes": [str(n) for n in self.routes],
            "addresses": [str(n) for n in self.addresses],
        }
        if self.sites is not None:
            out["sites"] = sorted(self.sites)
        return out


@dataclasses.dataclass(frozen=True, slots=True)
class OperatorKey:
    name: str
    public: PublicKey
    scope: OperatorScope | None = None  # None: may delegate any CS-ID, route, address


@dataclasses.dataclass(frozen=True, slots=True)
class Authorisation:
    """A delegation whose operator signature has been checked, ready for fast use."""

    delegation: Delegation
    node: PublicKey
    operator: OperatorKey
    cs_ids: frozenset[int]
    routes: tuple[IPNetwork, ...]
    addresses: tuple[IPNetwork, ...]
    sites: frozenset[int] | None = None  # None: every site (no SITE entry)
    _routes: tuple[_IntNetwork, ...] = dataclasses.field(init=False, repr=False, compare=False)
    _addresses: tuple[_IntNetwork, ...] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_routes", tuple(_as_ints(n) for n in self.routes))
        object.__setattr__(self, "_addresses", tuple(_as_ints(n) for n in self.addresses))

    @classmethod
    def of(cls, delegation: Delegation, node: PublicKey, operator: OperatorKey) -> Authorisation:
        return cls(
            delegation,
            node,
            operator,
            frozenset(e.cs_id for e in delegation.entries(ScopeKind.CS_ID)),
            tuple(e.network for e in delegation.entries(ScopeKind.ROUTE)),
            tuple(e.network for e in delegation.entries(ScopeKind.ADDRESS)),
            frozenset(e.site_id for e in delegation.entries(ScopeKind.SITE)) or None,
        )

    @property
    def key_id(self) -> bytes:
        return self.node.key_id

    def check_validity(self, now_ms: int) -> None:
        d = self.delegation
        if not d.not_before_ms <= now_ms < d.not_after_ms:
            raise KeyExpiredError(
                f"key {self.key_id.hex()} is authorised from {d.not_before_ms} "
                f"until {d.not_after_ms} ms, now is {now_ms}"
            )

    def check_scope(self, cs_id: int, address: IPAddress, nlri: IPNetwork, site_id: int) -> None:
        """Raise NotAuthorisedError unless the Origin's CS-ID, address and site id and the
        route are in this delegation's scope (draft, Verification step 5)."""
        if cs_id not in self.cs_ids:
            raise NotAuthorisedError(f"key {self.key_id.hex()} is not authorised for CS-ID {cs_id}")
        if self.sites is not None and site_id not in self.sites:
            raise NotAuthorisedError(
                f"key {self.key_id.hex()} is not authorised for site {site_id} "
                f"(its sites: {', '.join(str(s) for s in sorted(self.sites))})"
            )
        if not _address_within(address, self._addresses):
            raise NotAuthorisedError(
                f"key {self.key_id.hex()} is not authorised for instance address {address}"
            )
        if not _network_within(nlri, self._routes):
            raise NotAuthorisedError(f"key {self.key_id.hex()} is not authorised for route {nlri}")


@dataclasses.dataclass(frozen=True, slots=True)
class TrustStore:
    """Trusted operator keys and the node keys they authorise, by key id. Immutable:
    every change returns a new store."""

    operators: Mapping[bytes, OperatorKey] = dataclasses.field(
        default_factory=lambda: MappingProxyType({})
    )
    authorisations: Mapping[bytes, Authorisation] = dataclasses.field(
        default_factory=lambda: MappingProxyType({})
    )
    # node key ids that no delegation may authorise again, carried in-band or not
    revoked: frozenset[bytes] = frozenset()

    def with_operator(
        self, public_key: bytes, name: str = "", scope: OperatorScope | None = None
    ) -> TrustStore:
        """A store that also trusts this operator key (replacing one of the same id).
        Node keys it authorised before are not checked again against a new `scope`."""
        public = PublicKey.from_bytes(public_key)
        operators = {**self.operators, public.key_id: OperatorKey(name, public, scope)}
        return dataclasses.replace(self, operators=MappingProxyType(operators))

    def without_operator(self, operator_key_id: bytes) -> TrustStore:
        """Remove an operator and every node key it authorised (revocation)."""
        return TrustStore(
            MappingProxyType({k: v for k, v in self.operators.items() if k != operator_key_id}),
            MappingProxyType(
                {
                    k: a
                    for k, a in self.authorisations.items()
                    if a.operator.public.key_id != operator_key_id
                }
            ),
            self.revoked,
        )

    def without_key(self, node_key_id: bytes) -> TrustStore:
        """Revoke one node key before its delegation expires: forget its authorisation
        and refuse any delegation of it from now on (in-band ones included)."""
        return self.without_keys((node_key_id,))

    def without_keys(self, node_key_ids: Iterable[bytes]) -> TrustStore:
        """`without_key` for each of `node_key_ids`."""
        revoked = self.revoked | frozenset(bytes(k) for k in node_key_ids)
        if revoked == self.revoked and not revoked & self.authorisations.keys():
            return self
        auths = {k: v for k, v in self.authorisations.items() if k not in revoked}
        return dataclasses.replace(self, authorisations=MappingProxyType(auths), revoked=revoked)

    def lookup(self, node_key_id: bytes) -> Authorisation | None:
        return self.authorisations.get(node_key_id)

    def check_delegation(self, delegation: Delegation) -> Authorisation:
        """Check `delegation` against the operator keys, their scopes and the revoked
        keys; raises UnknownKeyError or BadDelegationError. Changes nothing."""
        operator = self.operators.get(delegation.operator_key_id)
        if operator is None:
            raise UnknownKeyError(
                f"delegation by operator key {delegation.operator_key_id.hex()}, "
                "which is not trusted"
            )
        node_key_id = key_id(delegation.node_key)
        if node_key_id in self.revoked:
            raise BadDelegationError(
                f"key {node_key_id.hex()} is revoked; its delegation is refused"
            )
        who = operator.name or operator.public.key_id.hex()
        if not operator.public.verify(
            delegation.operator_signature, delegation_message(delegation)
        ):
            raise BadDelegationError(
                f"operator signature of {who} "
                f"on the delegation of key {node_key_id.hex()} does not verify"
            )
        if operator.scope is not None:
            outside = operator.scope.outside(delegation)
            if outside is not None:
                raise BadDelegationError(
                    f"delegation of key {node_key_id.hex()} by {who}: {outside} is "
                    "outside operator scope"
                )
        try:
            node = PublicKey.from_bytes(delegation.node_key)
        except KeyFormatError as exc:
            raise BadDelegationError(str(exc)) from None
        current = self.authorisations.get(node.key_id)
        if (
            current is not None
            and current.delegation != delegation
            and current.delegation.not_before_ms >= delegation.not_before_ms
        ):
            raise BadDelegationError(
                f"delegation of key {node.key_id.hex()} from {delegation.not_before_ms} "
                f"is superseded by the one from {current.delegation.not_before_ms}"
            )
        return Authorisation.of(delegation, node, operator)

    def with_authorisation(self, authorisation: Authorisation) -> TrustStore:
        auths = {**self.authorisations, authorisation.key_id: authorisation}
        return dataclasses.replace(self, authorisations=MappingProxyType(auths))

    def with_delegation(self, delegation: Delegation) -> TrustStore:
        """A store that also trusts `delegation` (checked here; raises if it fails)."""
        return self.with_authorisation(self.check_delegation(delegation))

    # ---- the trust file --------------------------------------------------------------

    def to_json(self) -> JSON:
        operators: list[JSON] = []
        for o in self.operators.values():
            op: dict[str, JSON] = {
                "name": o.name,
                "public_key": o.public.raw.hex(),
                "key_id": o.public.key_id.hex(),
            }
            if o.scope is not None:
                op["scope"] = o.scope.to_json()
            operators.append(op)
        out: dict[str, JSON] = {
            "format": TRUST_FORMAT,
            "operators": operators,
            "delegations": [delegation_to_json(a.delegation) for a in self.authorisations.values()],
        }
        if self.revoked:
            out["revoked_keys"] = sorted(k.hex() for k in self.revoked)
        return out

    @classmethod
    def from_json(cls, obj: JSON) -> TrustStore:
        """Load a trust file; every delegation's operator signature (and scope) is checked
        here. A delegation of a key in `revoked_keys` is left out: revocation wins.
        Anything else than the documented shape raises `TrustFileError` naming the field."""
        if not isinstance(obj, dict) or obj.get("format") != TRUST_FORMAT:
            raise TrustFileError(f'a trust file is a JSON object with "format": "{TRUST_FORMAT}"')
        store = cls()
        for i, op in enumerate(_list(obj, "operators")):
            where = f"operators[{i}]"
            if not isinstance(op, dict):
                raise TrustFileError(f"{where} is {_shown(op)}, not a JSON object")
            if "public_key" not in op:
                raise TrustFileError(f"{where}: missing public_key")
            public = _hex(op["public_key"], f"{where}: public_key")
            name = op.get("name", "")
            if not isinstance(name, str):
                raise TrustFileError(f"{where}: name is {_shown(name)}, not a string")
            scope = _operator_scope(op["scope"], f"{where}: scope") if "scope" in op else None
            try:
                store = store.with_operator(public, name, scope)
            except KeyFormatError as exc:
                raise TrustFileError(f"{where}: public_key: {exc}") from None
            if "key_id" in op and op["key_id"] != key_id(public).hex():
                raise TrustFileError(f"{where}: key_id does not match public_key")
        revoked = []
        for i, text in enumerate(_list(obj, "revoked_keys")):
            raw = _hex(text, f"revoked_keys[{i}]")
            if len(raw) != KEY_ID_LEN:
                raise TrustFileError(
                    f"revoked_keys[{i}] {_shown(text)} is {len(raw)} bytes, "
                    f"a key id is {KEY_ID_LEN}"
                )
            revoked.append(raw)
        store = store.without_keys(revoked)
        for i, item in enumerate(_list(obj, "delegations")):
            try:
                delegation = delegation_from_json(item)
                if key_id(delegation.node_key) in store.revoked:
                    continue
                store = store.with_delegation(delegation)
            except (CodecError, TrustFileError) as exc:
                raise TrustFileError(f"delegations[{i}]: {exc}") from None
        return store


def _shown(value: object) -> str:
    """A JSON value as the file has it, cut short for a one-line message."""
    text = json.dumps(value, default=repr)
    return text if len(text) <= 40 else text[:37] + "..."


def _list(obj: dict[str, JSON], name: str, where: str = "") -> list[JSON]:
    """`obj[name]` if it is a list; absent counts as empty."""
    value = obj.get(name, [])
    if not isinstance(value, list):
        raise TrustFileError(f"{where}{name} is {_shown(value)}, not a list")
    return value


def _hex(value: JSON, what: str) -> bytes:
    if not isinstance(value, str):
        raise TrustFileError(f"{what} is {_shown(value)}, not a hex string")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise TrustFileError(f"{what} {_shown(value)} is not hex") from None


def _int(value: JSON, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TrustFileError(f"{what} is {_shown(value)}, not an integer")
    return value


def delegation_to_json(d: Delegation) -> JSON:
    """Readable form of a delegation (the trust file's and `catsproto authorize`'s);
    "sites" only when it lists any (absent: every site)."""
    out: dict[str, JSON] = {
        "format": DELEGATION_FORMAT,
        "algorithm": d.algorithm.name.lower(),
        "operator_key_id": d.operator_key_id.hex(),
        "node_key": d.node_key.hex(),
        "node_key_id": key_id(d.node_key).hex(),
        "not_before_ms": d.not_before_ms,
        "not_after_ms": d.not_after_ms,
        "cs_ids": [e.cs_id for e in d.entries(ScopeKind.CS_ID)],
        "routes": [str(e.network) for e in d.entries(ScopeKind.ROUTE)],
        "addresses": [str(e.network) for e in d.entries(ScopeKind.ADDRESS)],
        "operator_signature": d.operator_signature.hex(),
    }
    sites = d.entries(ScopeKind.SITE)
    if sites:
        out["sites"] = [e.site_id for e in sites]
    return out


def delegation_from_json(obj: JSON) -> Delegation:
    """Inverse of `delegation_to_json`; the result is exactly the delegation signed.
    A missing or mistyped field raises `TrustFileError` naming it; a value the TLV
    refuses (a range, a length) raises the codec's error."""
    if not isinstance(obj, dict):
        raise TrustFileError("a delegation is a JSON object")
    if "format" in obj and obj["format"] != DELEGATION_FORMAT:
        raise TrustFileError(
            f"delegation: format {_shown(obj['format'])} is not {DELEGATION_FORMAT}"
        )
    missing = [name for name in _DELEGATION_FIELDS if name not in obj]
    if missing:
        raise TrustFileError(f"delegation lacks {', '.join(missing)}")
    algorithm = obj["algorithm"]
    names = {a.name.lower(): a for a in SignatureAlgorithm}
    if not isinstance(algorithm, str) or algorithm.lower() not in names:
        raise TrustFileError(
            f"delegation: algorithm {_shown(algorithm)} is not one of {', '.join(names)}"
        )
    node_key = _hex(obj["node_key"], "delegation: node_key")
    scope = [
        ScopeEntry.for_cs_id(_int(c, f"delegation: cs_ids[{i}]"))
        for i, c in enumerate(_list(obj, "cs_ids", "delegation: "))
    ]
    for kind, name in ((ScopeKind.ROUTE, "routes"), (ScopeKind.ADDRESS, "addresses")):
        for i, text in enumerate(_list(obj, name, "delegation: ")):
            scope.append(ScopeEntry.for_network(kind, _network(text, f"delegation: {name}[{i}]")))
    # optional: absent (a delegation made before sites existed, or for every site) is none
    for i, site in enumerate(_list(obj, "sites", "delegation: ")):
        scope.append(ScopeEntry.for_site(_int(site, f"delegation: sites[{i}]")))
    d = Delegation(
        algorithm=names[algorithm.lower()],
        operator_key_id=_hex(obj["operator_key_id"], "delegation: operator_key_id"),
        node_key=node_key,
        not_before_ms=_int(obj["not_before_ms"], "delegation: not_before_ms"),
        not_after_ms=_int(obj["not_after_ms"], "delegation: not_after_ms"),
        operator_signature=_hex(obj["operator_signature"], "delegation: operator_signature"),
        scope=tuple(sorted(scope, key=ScopeEntry.key)),
    )
    if "node_key_id" in obj and obj["node_key_id"] != key_id(node_key).hex():
        raise TrustFileError("delegation: node_key_id does not match node_key")
    return d


_DELEGATION_FIELDS = (
    "algorithm",
    "operator_key_id",
    "node_key",
    "not_before_ms",
    "not_after_ms",
    "cs_ids",
    "routes",
    "addresses",
    "operator_signature",
)


def _operator_scope(obj: JSON, where: str) -> OperatorScope:
    """An operator's "scope": {"cs_ids": [...], "routes": [...], "addresses": [...]},
    and optionally "sites": [...] (absent: the operator may delegate any site)."""
    if not isinstance(obj, dict):
        raise TrustFileError(f"{where} is {_shown(obj)}, not a JSON object")
    missing = [name for name in ("cs_ids", "routes", "addresses") if name not in obj]
    if missing:
        raise TrustFileError(f"{where} lacks {', '.join(missing)}")
    at = f"{where}: "
    cs_ids = [_int(c, f"{at}cs_ids[{i}]") for i, c in enumerate(_list(obj, "cs_ids", at))]
    nets = {
        name: [_network(t, f"{at}{name}[{i}]") for i, t in enumerate(_list(obj, name, at))]
        for name in ("routes", "addresses")
    }
    sites = (
        [_int(s, f"{at}sites[{i}]") for i, s in enumerate(_list(obj, "sites", at))]
        if "sites" in obj
        else None
    )
    try:
        return OperatorScope.of(
            cs_ids=cs_ids, routes=nets["routes"], addresses=nets["addresses"], sites=sites
        )
    except ValueError as exc:
        raise TrustFileError(f"{where}: {exc}") from None


def _network(value: JSON, what: str) -> IPNetwork:
    if not isinstance(value, str):
        raise TrustFileError(f"{what} is {_shown(value)}, not a string")
    try:
        return ipaddress.ip_network(value)
    except ValueError as exc:
        raise TrustFileError(f"{what}: {exc}") from None

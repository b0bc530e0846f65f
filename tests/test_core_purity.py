"""The pure core stays pure: no module of the codec, keys, summaries, security, node
model, selector, simulator or transfer core imports I/O, processes, threads, the clock
or the daemons' libraries, nor the project's edges (adapters, lab, commands).

Read from the source with `ast`, not by importing: an import inside a function counts
as much as one at the top, and a forbidden module that is not installed here still
shows. Time, keys and random seeds are parameters of the core; an adapter passes them
in. When this fails, move the I/O into `catsproto/adapters/` and hand the core its
result (or its clock) instead.

Allowed on purpose: `cryptography` (Ed25519 and the AEAD are computation, not I/O),
`numpy` and `numba` (arrays and compiled loops), `json` (text in, objects out) and
`hashlib`. Nothing in the core needs any module of the forbidden list today, so none
is excepted."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "catsproto"
CORE_PACKAGES = ("wire", "summary", "security", "node", "selector", "sim", "transfer")
CORE_MODULES = ("keys.py", "kernels.py")

# I/O, processes, threads, event loops, the clock, the daemons' and capture libraries
FORBIDDEN = (
    "socket",
    "subprocess",
    "asyncio",
    "selectors",
    "threading",
    "multiprocessing",
    "pyroute2",
    "scapy",
    "exabgp",
    "zmq",
    "http",
    "urllib",
    "requests",
    "time",  # the clock is a parameter (`now`)
    "catsproto.adapters",
    "catsproto.lab",
    "catsproto.commands",
)


def core_files() -> list[Path]:
    files = [f for p in CORE_PACKAGES for f in sorted((PACKAGE / p).rglob("*.py"))]
    return files + [PACKAGE / m for m in CORE_MODULES]


def package_of(path: Path) -> str:
    """The package a module file belongs to (its `__package__`): `catsproto.wire` for
    both `catsproto/wire/tlvs.py` and `catsproto/wire/__init__.py`."""
    return ".".join(path.relative_to(PACKAGE.parent).parent.parts)


def imports(source: str, package: str = "catsproto.core") -> Iterator[tuple[int, str]]:
    """(line, module name) of every import in `source` (a module of `package`), wherever
    it sits: top level, functions, classes, `if TYPE_CHECKING` blocks. `from a import b`
    gives both `a` and `a.b` (b may be a module); a relative import is resolved against
    `package`; `importlib.import_module("x")` and `__import__("x")` with a literal count."""
    parts = package.split(".")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts[: len(parts) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            yield node.lineno, target
            for alias in node.names:
                if alias.name != "*":
                    yield node.lineno, f"{target}.{alias.name}"
        elif isinstance(node, ast.Call) and node.args:
            func, first = node.func, node.args[0]
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and isinstance(first, ast.Constant):
                yield node.lineno, str(first.value)


def forbidden(names: Iterable[tuple[int, str]]) -> list[tuple[int, str]]:
    return [
        (line, name)
        for line, name in names
        if any(name == f or name.startswith(f + ".") for f in FORBIDDEN)
    ]


def test_the_core_imports_nothing_forbidden():
    files = core_files()
    found = {
        f"{path.relative_to(PACKAGE.parent)}:{line}: {name}"
        for path in files
        for line, name in forbidden(imports(path.read_text(), package_of(path)))
    }
    assert not found, "the pure core imports I/O or an edge:\n" + "\n".join(sorted(found))


# ---- the walker can fail -------------------------------------------------------------


def test_the_walk_covers_every_core_package():
    files = core_files()
    for package in CORE_PACKAGES:
        assert (PACKAGE / package / "__init__.py") in files, package
    assert PACKAGE / "keys.py" in files
    assert len(files) >= 50  # 72 when written; a wrong root would find a handful


def test_the_walker_finds_real_imports():
    seen = {
        name
        for path in (PACKAGE / "selector").rglob("*.py")
        for _, name in imports(path.read_text(), package_of(path))
    }
    assert "numpy" in seen
    assert "catsproto.wire" in seen
    keys = {name for _, name in imports((PACKAGE / "keys.py").read_text(), "catsproto")}
    assert "hashlib" in keys


SYNTHETIC = """
import numpy as np
from catsproto import wire, adapters
import time as clock

def later():
    import socket
    from http.server import HTTPServer
    from ..lab import runner
    import importlib
    return importlib.import_module("subprocess")

class Node:
    def run(self):
        from urllib.parse import quote
        from catsproto.commands.inspect import cmd_inspect
        return __import__("zmq")

def fine():
    import timeit, socketserver_like
    from catsproto.security import commands
    from catsproto.wire.codes import Tier
"""


def test_the_walker_flags_forbidden_imports_wherever_they_are():
    got = forbidden(imports(SYNTHETIC, "catsproto.node"))
    assert sorted(name for _, name in got) == [
        "catsproto.adapters",
        "catsproto.commands.inspect",
        "catsproto.commands.inspect.cmd_inspect",
        "catsproto.lab",
        "catsproto.lab.runner",
        "http.server",
        "http.server.HTTPServer",
        "socket",
        "subprocess",
        "time",
        "urllib.parse",
        "urllib.parse.quote",
        "zmq",
    ]
    lines = SYNTHETIC.splitlines()
    for line, name in got:
        assert name.split(".")[-1] in lines[line - 1] or name.split(".")[0] in lines[line - 1]


@pytest.mark.parametrize(
    ("source", "path", "expected", "flagged"),
    [
        ("from . import buffer", "wire/tlvs.py", "catsproto.wire.buffer", False),
        ("from .errors import X", "wire/__init__.py", "catsproto.wire.errors", False),
        ("from .. import lab", "wire/tlvs.py", "catsproto.lab", True),
        (
            "from ..adapters.pcap import findings",
            "selector/rib.py",
            "catsproto.adapters.pcap",
            True,
        ),
        ("from .adapters import pcap", "keys.py", "catsproto.adapters.pcap", True),
    ],
)
def test_relative_imports_resolve_against_the_package(source, path, expected, flagged):
    found = list(imports(source, package_of(PACKAGE / path)))
    assert expected in {name for _, name in found}
    assert bool(forbidden(found)) is flagged

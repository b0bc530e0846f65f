"""`catsproto dissector`: install the Wireshark Lua dissector as a personal plugin.

Wireshark (2.5 and later) loads every Lua file in ``~/.local/lib/wireshark/plugins``;
`install` copies lab/wireshark/catsproto.lua there (or to --dir), `path` prints where
the dissector file is, for ``tshark -X lua_script:PATH``.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from catsproto.commands import UsageError

SOURCE = Path(__file__).resolve().parents[2] / "lab" / "wireshark" / "catsproto.lua"


def personal_plugin_dir() -> Path:
    return Path.home() / ".local" / "lib" / "wireshark" / "plugins"


def cmd_dissector(args: argparse.Namespace) -> int:
    if not SOURCE.is_file():
        raise UsageError(f"dissector source {SOURCE} is missing (run from a source checkout)")
    if args.action == "path":
        print(SOURCE)
        return 0
    target_dir = Path(args.dir) if args.dir else personal_plugin_dir()
    try:
        target_dir.mkdir(parents=True, exist_ok=True)
        target = target_dir / SOURCE.name
        shutil.copyfile(SOURCE, target)
    except OSError as exc:
        raise UsageError(f"cannot install into {target_dir}: {exc.strerror}") from None
    print(f"installed {target}; restart Wireshark (tshark loads it on its next run)")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "dissector",
        help="install the Wireshark Lua dissector (or print its path)",
        description="Copy lab/wireshark/catsproto.lua into Wireshark's personal Lua plugin "
        "folder (~/.local/lib/wireshark/plugins), or print its path.",
    )
    p.add_argument(
        "action",
        choices=["install", "path"],
        help="install: copy the dissector into the plugin folder; path: print where its "
        "source file is (for tshark -X lua_script:PATH)",
    )
    p.add_argument("--dir", help="plugin folder to install into (default: the personal one)")
    p.set_defaults(func=cmd_dissector)

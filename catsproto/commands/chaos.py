"""`catsproto chaos`: the fault, churn and hostile-peer campaign against the real lab.

    catsproto chaos                        # all seven scenarios, scaled-down durations
    catsproto chaos --full                 # a minute of storm, hostile traffic and load
    catsproto chaos --only crash hostile   # some of them
    catsproto chaos --json results.json    # every figure, not only the table
    catsproto chaos --keep                 # keep the run directories (logs, captures)

The scenarios, in order: crash (kill -9 of an instance and its ExaBGP), link (a link
cut and restored, then a loss burst), transit (FRR, then BIRD, killed and restarted),
selector (the receiver's ExaBGP and RIB restarted), storm (an eviction storm and
churn), hostile (a peer sending malformed, unsigned, replayed and forged UPDATEs), load
(the steering request API under 1,000 requests/s). Needs root (namespaces, FRR, BIRD).
Each scenario builds the chaos lab (lab/faults/chaos.clab.yml), injects its fault,
measures and tears the lab down by PID. The run directories go into a new temporary
folder that is removed at the end, pass or fail, unless --keep or --root is given.
Results and their meaning: docs/chaos.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

from catsproto.adapters.output_files import OutputFileError, check_writable
from catsproto.commands import UsageError

SCENARIO_NAMES = ("crash", "link", "transit", "selector", "storm", "hostile", "load")
"""The campaign's scenarios (`catsproto.lab.faults.campaign.SCENARIOS`, which takes a
second to import: too slow for every start of the CLI); tests/test_cli.py checks they
are the same."""


def cmd_chaos(args: argparse.Namespace) -> int:
    from catsproto.lab.faults import campaign

    if os.geteuid() != 0:
        raise UsageError("chaos needs root: network namespaces, FRR and BIRD")
    unknown = [n for n in args.only or [] if n not in campaign.SCENARIOS]
    if unknown:
        raise UsageError(f"no scenario {', '.join(unknown)} (have {', '.join(campaign.SCENARIOS)})")
    if args.json:
        try:
            check_writable("--json", args.json)
        except OutputFileError as exc:
            raise UsageError(str(exc)) from None
    if args.root:
        try:
            Path(args.root).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"--root {args.root}: cannot create: {exc.strerror or exc}") from None
        return _campaign(args, Path(args.root))
    root = Path(tempfile.mkdtemp(prefix="catsproto-chaos-"))
    try:
        return _campaign(args, root)
    finally:
        if args.keep:
            print(f"run directories kept under {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


def _campaign(args: argparse.Namespace, root: Path) -> int:
    from catsproto.lab.faults import campaign

    def progress(r: campaign.Result) -> None:
        verdict = "pass" if r.passed else "FAIL"
        print(f"  {r.scenario:<9} {verdict}  ({r.seconds:.0f}s)", flush=True)

    print(f"chaos campaign ({'full' if args.full else 'scaled'} durations), runs under {root}")
    results = campaign.run_all(root, args.only, full=args.full, progress=progress)
    print()
    print(campaign.table(results))
    for r in results:
        for note in r.notes:
            print(f"\n{r.scenario}: {note.strip()}")
    if args.json:
        try:
            Path(args.json).write_text(
                json.dumps([r.to_json() for r in results], indent=1, default=str)
            )
        except OSError as exc:
            raise UsageError(f"--json {args.json}: cannot write: {exc.strerror or exc}") from None
    return 0 if all(r.passed for r in results) else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "chaos",
        help="fault, churn and hostile-peer campaign in the lab (root)",
        description=__doc__,
    )
    p.add_argument(
        "--full",
        action="store_true",
        help="longer runs: 60 s of eviction storm, hostile traffic and load (not 10, 8 and 8 "
        "s), a 5 s loss burst (not 3 s), 3 s of steering after a crash is detected (not "
        "1.5 s); about 4 minutes in all instead of about 80 s",
    )
    p.add_argument(
        "--only",
        nargs="+",
        metavar="SCENARIO",
        help=f"run only these scenarios, of: {', '.join(SCENARIO_NAMES)} (default: all)",
    )
    p.add_argument("--json", metavar="FILE", help="write every figure as JSON")
    p.add_argument(
        "--root",
        metavar="DIR",
        help="folder for the scenarios' run directories, created if missing and left in "
        "place (default: a new temporary folder, removed at the end unless --keep)",
    )
    p.add_argument(
        "--keep",
        action="store_true",
        help="keep the temporary folder of run directories (daemon logs, plans) and print "
        "where it is",
    )
    p.set_defaults(func=cmd_chaos)

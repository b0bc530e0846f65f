"""`catsproto chaos`: the fault, churn and hostile-peer campaign against the real lab.

catsproto chaos                        # all seven scenarios, scaled-down durations
catsproto chaos --full                 # the issue's durations (a minute of storm, attack, load)
catsproto chaos --only crash hostile   # some of them
catsproto chaos --json results.json    # every figure, not only the table

Needs root (namespaces, FRR, BIRD). Each scenario builds the chaos lab
(lab/faults/chaos.clab.yml), injects its fault, measures and tears the lab down by PID.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from catsproto.commands import UsageError


def cmd_chaos(args: argparse.Namespace) -> int:
    from catsproto.lab.faults import campaign

    if os.geteuid() != 0:
        raise UsageError("chaos needs root: network namespaces, FRR and BIRD")
    unknown = [n for n in args.only or [] if n not in campaign.SCENARIOS]
    if unknown:
        raise UsageError(f"no scenario {', '.join(unknown)} (have {', '.join(campaign.SCENARIOS)})")
    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="catsproto-chaos-"))

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
        Path(args.json).write_text(
            json.dumps([r.to_json() for r in results], indent=1, default=str)
        )
    return 0 if all(r.passed for r in results) else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "chaos",
        help="fault, churn and hostile-peer campaign in the lab (root)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--full", action="store_true", help="the issue's minute-long durations")
    p.add_argument("--only", nargs="+", metavar="SCENARIO", help="run only these")
    p.add_argument("--json", metavar="FILE", help="write every figure as JSON")
    p.add_argument("--root", metavar="DIR", help="run directories (default: a temp dir)")
    p.set_defaults(func=cmd_chaos)

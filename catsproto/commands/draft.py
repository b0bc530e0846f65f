"""`catsproto draft`: render the Internet-Draft, regenerate its vectors, check it.

    catsproto draft render [--out DIR]    drafts/render: vectors, kramdown-rfc, xml2rfc
    catsproto draft vectors [--check]     write (or check) drafts/vectors.md
    catsproto draft check [--out DIR]     render, then the idnits-style checks

Works from a source checkout (the draft lives in drafts/, not in the package). Exit
status: 0 when all is well, 1 when a check fails or a tool reports an error, 2 on
bad input (no drafts/ directory).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from catsproto import draft
from catsproto.commands import UsageError

NAME = "draft-catsproto-cats-kv-cache-bgp"


def _root() -> Path:
    root = Path(__file__).resolve().parents[2]
    if not (root / "drafts" / f"{NAME}.md").exists():
        raise UsageError(f"no drafts/{NAME}.md next to the package: run from a source checkout")
    return root


def _vectors_text(root: Path) -> str:
    vectors = root / "tests" / "vectors"
    return draft.vectors_from_files(
        {name: (vectors / f"{name}.json").read_text() for name in draft.VECTOR_FILES}
    )


def _render(root: Path, out: Path | None, keep_vectors: bool = False) -> int:
    cmd = [str(root / "drafts" / "render")]
    if out is not None:
        cmd.append(str(out))
    env = dict(os.environ, PYTHON=sys.executable)
    if keep_vectors:
        env["DRAFT_VECTORS"] = "keep"
    return subprocess.run(cmd, env=env, check=False).returncode


def cmd_render(args: argparse.Namespace) -> int:
    return 0 if _render(_root(), args.out) == 0 else 1


def cmd_vectors(args: argparse.Namespace) -> int:
    root = _root()
    path = root / "drafts" / "vectors.md"
    text = _vectors_text(root)
    if args.check:
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            print(f"{path} is out of date: run `catsproto draft vectors`", file=sys.stderr)
            return 1
        print("drafts/vectors.md matches tests/vectors/*.json")
        return 0
    path.write_text(text, encoding="utf-8")
    print("wrote drafts/vectors.md")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    root = _root()
    out = args.out or root / "drafts" / "build"
    problems = []
    vectors_md = (root / "drafts" / "vectors.md").read_text(encoding="utf-8")
    if vectors_md != _vectors_text(root):
        problems.append("drafts/vectors.md differs from what tests/vectors/*.json generate")
    markdown = (root / "drafts" / f"{NAME}.md").read_text(encoding="utf-8")
    problems += draft.markdown_problems(markdown, vectors_md)
    if _render(root, out, keep_vectors=True) != 0:
        problems.append("rendering failed (see the messages above)")
    else:
        problems += draft.text_problems((Path(out) / f"{NAME}.txt").read_text(encoding="utf-8"))
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "draft",
        help="render and check the Internet-Draft (drafts/)",
        description="Render the project's Internet-Draft offline with kramdown-rfc and "
        "xml2rfc, regenerate its test-vector appendix, or run the idnits-style checks.",
    )
    sub = p.add_subparsers(dest="draft_command", required=True)
    r = sub.add_parser(
        "render",
        help="write .xml, .txt and .html (default drafts/build)",
        description="Render the draft offline: regenerate its vector appendix "
        "(drafts/vectors.md) from tests/vectors/*.json, then kramdown-rfc makes the XML and "
        "xml2rfc the text and HTML, in --out. Exit 1 if either tool reports an error.",
    )
    r.add_argument(
        "--out",
        type=Path,
        help="directory for the .xml, .txt and .html (default: drafts/build of the checkout)",
    )
    r.set_defaults(func=cmd_render)
    v = sub.add_parser(
        "vectors",
        help="write drafts/vectors.md from tests/vectors/*.json",
        description="Regenerate the draft's test-vector appendix, drafts/vectors.md, from "
        "tests/vectors/wire.json, keys.json, security.json and transfer.json, and print the "
        "file written; with --check write nothing, print a line if it is up to date and "
        "exit 1 if not.",
    )
    v.add_argument("--check", action="store_true", help="fail if the file is out of date")
    v.set_defaults(func=cmd_vectors)
    c = sub.add_parser(
        "check",
        help="render, then check line length, ASCII, references, tables",
        description="Check that drafts/vectors.md matches the vector files, render the "
        "draft with it as committed, and run the idnits-style checks on the markdown and "
        "the text (line length, ASCII, references, tables). Each problem is one line on "
        "stderr; exit 1 if there is any.",
    )
    c.add_argument("--out", type=Path, help="output directory (default drafts/build)")
    c.set_defaults(func=cmd_check)

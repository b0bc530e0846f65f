"""The docs' links and commands resolve (issue #29): every relative link in README.md and
docs/**/*.md names a file that exists, every `#anchor` (in such a link, or in-page)
matches a heading of its target page by GitHub's slug rules, and every shell command in a
fenced code block that starts with `catsproto `, `.venv/bin/catsproto ` or
`sudo .venv/bin/catsproto ` names a subcommand path the CLI has (`catsproto PATH --help`,
run once per distinct path), and every `benchmarks/*.py` or `scripts/*` a command line
names exists. All failures are reported at once, each with its page and line.

The checker's own tests at the bottom show it failing on broken pages."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import unicodedata
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[1]
HELP_TIMEOUT_S = 60

# ---- reading a markdown page -----------------------------------------------------------

FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([^`\s]*)")  # fences in list items too
ATX = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
INLINE_LINK = re.compile(
    r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*<?([^)\s>]*)>?(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)"
)
REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$")
HTML_ATTR = re.compile(r"<(?:a|img)\b[^>]*?\b(?:href|src)=\"([^\"]*)\"", re.I)
HTML_ID = re.compile(r"<[a-z][^>]*?\b(?:id|name)=\"([^\"]+)\"", re.I)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
SHELL_INFO = {"", "sh", "bash", "shell", "console", "zsh", "shell-session"}
COMMAND_PREFIXES = ("sudo .venv/bin/catsproto ", ".venv/bin/catsproto ", "catsproto ")
SCRIPT_REF = re.compile(
    r"(?:^|(?<=[\s=\"'(]))(?:\./)?((?:benchmarks/[^\s\"'();|&]+\.py)|(?:scripts/[^\s\"'();|&]+))"
)


@dataclass
class Page:
    path: Path
    text_lines: list[tuple[int, str]] = field(default_factory=list)  # outside code blocks
    code_blocks: list[tuple[str, list[tuple[int, str]]]] = field(default_factory=list)
    headings: list[str] = field(default_factory=list)


def read_page(path: Path) -> Page:
    page = Page(path)
    fence: tuple[str, int] | None = None
    block: list[tuple[int, str]] = []
    info = ""
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if fence is not None:
            m = FENCE.match(line)
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= fence[1] and not m.group(2):
                page.code_blocks.append((info, block))
                fence = None
            else:
                block.append((number, line))
            continue
        m = FENCE.match(line)
        if m:
            fence = (m.group(1)[0], len(m.group(1)))
            info, block = m.group(2).lower(), []
            continue
        page.text_lines.append((number, line))
        h = ATX.match(line)
        if h:
            page.headings.append(h.group(2) or "")
    if fence is not None:  # an unclosed fence runs to the end of the page
        page.code_blocks.append((info, block))
    return page


def _mask_code(line: str) -> str:
    """The line with each code span's content blanked to x's (same length), so that no
    link is found inside code, while a link whose text is code is still found."""
    return CODE_SPAN.sub(lambda m: m.group(1) + "x" * len(m.group(2)) + m.group(1), line)


def heading_text(raw: str) -> str:
    """A heading's text as GitHub renders it (the slug is made from the rendered text)."""
    parts = re.split(r"(`+)(.+?)\1", raw)
    out = []
    for i, part in enumerate(parts):
        kind = i % 3
        if kind == 1:
            continue  # the backtick run itself
        if kind == 2:
            out.append(part)  # code: verbatim
            continue
        part = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", part)  # links and images: their text
        part = re.sub(r"<[^>]+>", "", part)  # inline HTML
        part = part.replace("*", "")
        # _emphasis_ goes, snake_case stays
        part = re.sub(r"(?<![A-Za-z0-9])_+|_+(?![A-Za-z0-9])", "", part)
        out.append(part)
    return "".join(out).strip()


def slug(raw_heading: str) -> str:
    """GitHub's anchor for a heading: lower-case, punctuation other than `-` and `_`
    removed, each space a `-`."""
    text = heading_text(raw_heading).lower()
    kept = "".join(
        ch
        for ch in text
        if ch in " -_" or unicodedata.category(ch)[0] in "LMN" or unicodedata.category(ch) == "Pc"
    )
    return kept.replace(" ", "-")


@cache
def anchors_of(path: Path) -> frozenset[str]:
    page = read_page(path)
    seen: dict[str, int] = {}
    anchors = set()
    for raw in page.headings:
        base = slug(raw)
        n = seen.get(base, 0)
        seen[base] = n + 1
        anchors.add(base if n == 0 else f"{base}-{n}")
    for _, line in page.text_lines:
        anchors.update(a.lower() for a in HTML_ID.findall(line))
    return frozenset(anchors)


def links_of(page: Page) -> Iterable[tuple[int, str]]:
    for number, line in page.text_lines:
        masked = _mask_code(line)
        for m in INLINE_LINK.finditer(masked):
            yield number, m.group(2)
        m = REF_DEF.match(masked)
        if m:
            yield number, m.group(1)
        for target in HTML_ATTR.findall(masked):
            yield number, target


def check_link(page: Path, target: str, root: Path) -> str | None:
    """Why a link's target does not resolve, or None when it does."""
    if not target or SCHEME.match(target) or target.startswith("//"):
        return None
    where, _, anchor = target.partition("#")
    where = unquote(where)
    if where:
        dest = (root / where.lstrip("/")) if where.startswith("/") else (page.parent / where)
        dest = dest.resolve()
        if not dest.is_relative_to(root.resolve()):
            return f"link {target!r} leaves the repository"
        if not dest.exists():
            return f"link {target!r}: no such file {dest.relative_to(root.resolve())}"
    else:
        dest = page
    is_page = dest.is_file() and dest.suffix == ".md"
    if anchor and is_page and unquote(anchor).lower() not in anchors_of(dest):
        name = "this page" if dest == page else str(dest.relative_to(root.resolve()))
        return f"link {target!r}: no heading #{anchor} in {name}"
    return None


# ---- commands ----------------------------------------------------------------------------


def command_lines(page: Page) -> Iterable[tuple[int, str]]:
    """(line number, command) for every shell line of the page's fenced blocks, with
    backslash continuations joined and a `$ ` prompt taken off."""
    for info, block in page.code_blocks:
        if info not in SHELL_INFO:
            continue
        pending: tuple[int, str] | None = None
        for number, line in block:
            text = line.strip()
            if pending is not None:
                text = pending[1] + " " + text
                number = pending[0]
                pending = None
            if text.startswith("$ "):
                text = text[2:]
            if text.endswith("\\"):
                pending = (number, text[:-1].rstrip())
                continue
            yield number, text
        if pending is not None:
            yield pending


def catsproto_words(command: str) -> list[str] | None:
    """The words after `catsproto` of a command line that starts with it (comments
    dropped; `a | b` and `a|b` taken as alternatives, as the README's lists write them),
    or None for any other line."""
    if not command.startswith(COMMAND_PREFIXES):
        return None
    rest = command.split("catsproto ", 1)[1]
    try:
        words = shlex.split(rest, comments=True)
    except ValueError:
        words = rest.split("#", 1)[0].split()
    joined: list[str] = []
    for word in words:
        if joined and (word == "|" or joined[-1].endswith("|")):
            joined[-1] += word
        else:
            joined.append(word)
    return joined


HelpRunner = Callable[[tuple[str, ...]], tuple[int, str]]


def catsproto_exe() -> list[str]:
    venv = ROOT / ".venv" / "bin" / "catsproto"
    if venv.exists():
        return [str(venv)]
    beside = Path(sys.executable).parent / "catsproto"
    return [str(beside)] if beside.exists() else [sys.executable, "-m", "catsproto.cli"]


@cache
def run_help(path: tuple[str, ...]) -> tuple[int, str]:
    """`catsproto PATH --help`: its exit status and output (each path run once)."""
    try:
        done = subprocess.run(
            [*catsproto_exe(), *path, "--help"],
            capture_output=True,
            text=True,
            timeout=HELP_TIMEOUT_S,
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired:
        return -1, f"timed out after {HELP_TIMEOUT_S} s"
    return done.returncode, done.stdout + done.stderr


def subcommands(help_text: str) -> set[str]:
    """The subcommand names argparse lists in a --help (4-space indented entries under
    "positional arguments:"); empty for a command without subcommands."""
    names: set[str] = set()
    inside = False
    for line in help_text.splitlines():
        if line.endswith(":") and not line.startswith(" "):
            inside = line.startswith("positional arguments")
            continue
        if inside:
            m = re.match(r"^    ([A-Za-z0-9][\w-]*)(?:\s|$)", line)
            if m:
                names.add(m.group(1))
    return names


def check_command(words: list[str], run: HelpRunner) -> str | None:
    """Walk a command's words down the CLI's subcommands: every word in subcommand
    position must be one (each alternative of `a|b`), and its path's --help must exit 0."""
    paths: list[tuple[str, ...]] = [()]
    for word in words:
        if word.startswith("-"):
            break
        deeper: list[tuple[str, ...]] = []
        for path in paths:
            rc, text = run(path)
            if rc != 0:
                return f"`catsproto {' '.join(path)} --help` exited {rc}: {text.strip()[-200:]}"
            names = subcommands(text)
            if not names:
                continue
            for alternative in word.split("|"):
                if alternative not in names:
                    where = " ".join(("catsproto", *path))
                    known = ", ".join(sorted(names))
                    return f"`{where}` has no subcommand {alternative!r} (it has: {known})"
                deeper.append((*path, alternative))
        if not deeper:
            break
        paths = deeper
    for path in paths:
        rc, text = run(path)
        if rc != 0:
            return f"`catsproto {' '.join(path)} --help` exited {rc}: {text.strip()[-200:]}"
    return None


def prefetch_help(commands: list[list[str]], run: HelpRunner, workers: int = 4) -> None:
    """Run the --help of every subcommand path the commands reach, a level at a time,
    several at once (the same walk as `check_command`; each path still runs once)."""
    frontier = {(words, ()) for words in map(tuple, commands)}
    with ThreadPoolExecutor(workers) as pool:
        while frontier:
            paths = sorted({path for _, path in frontier})
            helps = dict(zip(paths, pool.map(run, paths), strict=True))
            deeper = set()
            for words, path in frontier:
                rc, text = helps[path]
                names = subcommands(text) if rc == 0 else set()
                depth = len(path)
                if not names or depth >= len(words) or words[depth].startswith("-"):
                    continue
                for alternative in words[depth].split("|"):
                    if alternative in names:
                        deeper.add((words, (*path, alternative)))
            frontier = deeper


def script_refs(command: str) -> list[str]:
    return SCRIPT_REF.findall(command.split(" #", 1)[0])


# ---- the whole check -----------------------------------------------------------------------


def doc_pages(root: Path) -> list[Path]:
    pages = [root / "README.md"] if (root / "README.md").exists() else []
    return pages + sorted((root / "docs").rglob("*.md"))


def check_pages(pages: Iterable[Path], root: Path, run: HelpRunner = run_help) -> list[str]:
    failures: list[str] = []
    read = [(path, read_page(path)) for path in pages]
    commands = [
        words
        for _, page in read
        for _, command in command_lines(page)
        if (words := catsproto_words(command)) is not None
    ]
    prefetch_help(commands, run)
    for path, page in read:
        name = path.relative_to(root)
        for number, target in links_of(page):
            why = check_link(path, target, root)
            if why:
                failures.append(f"{name}:{number}: {why}")
        for number, command in command_lines(page):
            words = catsproto_words(command)
            if words is not None:
                why = check_command(words, run)
                if why:
                    failures.append(f"{name}:{number}: {why}  [{command}]")
            for ref in script_refs(command):
                if not (root / ref).exists():
                    failures.append(f"{name}:{number}: {ref} does not exist  [{command}]")
    return failures


def test_every_link_anchor_and_command_in_the_docs_resolves() -> None:
    pages = doc_pages(ROOT)
    assert len(pages) > 10
    failures = check_pages(pages, ROOT)
    assert not failures, f"{len(failures)} broken in the docs:\n" + "\n".join(failures)


# ---- the checker fails when it should -------------------------------------------------------


def test_slugs_follow_githubs_rules() -> None:
    assert slug("Ranking by the work a choice makes (`SelectorConfig.work_weight`)") == (
        "ranking-by-the-work-a-choice-makes-selectorconfigwork_weight"
    )
    assert slug("Real TTFT against network-only CATS (`benchmarks/engine_e2e.py`)") == (
        "real-ttft-against-network-only-cats-benchmarksengine_e2epy"
    )
    assert slug("The trace's 3-second clock (`arrival_spread`)") == (
        "the-traces-3-second-clock-arrival_spread"
    )
    assert slug("Über *alles*, [linked](x.md) — 2×") == "über-alles-linked--2"


def test_the_checker_reports_each_broken_link_anchor_and_command(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "real.py").write_text("")
    (tmp_path / "README.md").write_text(
        "# Top\n\n## A section (`x_y`)\n\n"
        "[ok](docs/a.md) [ok](docs/a.md#second-part) [ok](#a-section-x_y) [ok](https://x.org/#z)\n"
        "[gone](docs/missing.md)\n"
        "[bad anchor](docs/a.md#no-such-part)\n"
        "[bad here](#nowhere) `[not a link](in-code.md)`\n"
    )
    (tmp_path / "docs" / "a.md").write_text(
        "# A\n\n## Second part\n\n![img](../README.md)\n\n"
        "```sh\n"
        "catsproto eval --report x     # fine\n"
        "sudo .venv/bin/catsproto lab up|status cats4\n"
        "catsproto lab upp cats4\n"
        ".venv/bin/catsproto nosuchcommand --flag\n"
        ".venv/bin/python benchmarks/real.py && ./scripts/nothere\n"
        ".venv/bin/python benchmarks/missing.py\n"
        "```\n\n"
        "```\n[also not a link](nope.md)\n```\n"
    )
    failures = check_pages(doc_pages(tmp_path), tmp_path)
    text = "\n".join(failures)
    assert "README.md:6: link 'docs/missing.md': no such file docs/missing.md" in text
    assert (
        "README.md:7: link 'docs/a.md#no-such-part': no heading #no-such-part in docs/a.md" in text
    )
    assert "README.md:8: link '#nowhere': no heading #nowhere in this page" in text
    assert "docs/a.md:10: `catsproto lab` has no subcommand 'upp'" in text
    assert "docs/a.md:11: `catsproto` has no subcommand 'nosuchcommand'" in text
    assert "docs/a.md:12: scripts/nothere does not exist" in text
    assert "docs/a.md:13: benchmarks/missing.py does not exist" in text
    assert len(failures) == 7, text


def test_alternatives_and_pipes_in_command_lists() -> None:
    assert catsproto_words("catsproto keygen | authorize | trust   # keys") == [
        "keygen|authorize|trust"
    ]
    assert catsproto_words("catsproto lab up|status cats4 --seal") == [
        "lab",
        "up|status",
        "cats4",
        "--seal",
    ]
    assert catsproto_words(".venv/bin/python x.py") is None

"""The module docstring of `catsproto.lab.reflectors` says what the code does: the lab
file it names exists and is what the generator writes by default, every command-line
option it names is one the generator accepts (and it names them all), and every
keyword argument it names is one `reflector_topology` takes."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from catsproto.lab import reflectors

ROOT = Path(__file__).resolve().parents[1]
DOC = reflectors.__doc__ or ""


def _generator_options(capsys: pytest.CaptureFixture[str]) -> set[str]:
    with pytest.raises(SystemExit) as done:
        reflectors.main(["--help"])
    assert done.value.code == 0
    return set(re.findall(r"--[a-z][a-z-]*", capsys.readouterr().out)) - {"--help"}


def test_the_lab_file_named_is_what_the_generator_writes() -> None:
    named = re.findall(r"`(lab/[\w.-]+\.clab\.yml)`", DOC)
    assert named == ["lab/catsrr.clab.yml"]
    assert "`lab/catsrr.clab.yml` is `render(reflector_topology(4, 2))`" in DOC
    written = reflectors.render(reflectors.reflector_topology(4, 2))
    assert (ROOT / named[0]).read_text() == written
    assert reflectors.render(reflectors.reflector_topology(4)) == written  # the defaults


def test_the_options_named_are_the_generators(capsys: pytest.CaptureFixture[str]) -> None:
    options = _generator_options(capsys)
    named = set(re.findall(r"`(--[a-z][a-z-]*)`", DOC))
    assert named == options  # none it lacks (--reflect-to, --spool-poll), none left out
    assert not re.search(r"--reflect-to|--spool-poll", DOC)


def test_the_keyword_arguments_named_exist() -> None:
    params = inspect.signature(reflectors.reflector_topology).parameters
    for name in ("min_interval", "reflect_to", "spool_poll"):
        assert f"`{name}`" in DOC
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY

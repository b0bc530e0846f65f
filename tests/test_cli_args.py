"""The argument types the commands share: each refuses with one line naming the value."""

from __future__ import annotations

import argparse

import pytest

from catsproto.adapters.cli_args import seconds, whole_number


def _parser(kind) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="t", exit_on_error=False)
    p.add_argument("--x", type=kind)
    return p


@pytest.mark.parametrize(
    ("minimum", "zero_means", "text", "value"),
    [(1, None, "1", 1), (1, None, "70", 70), (0, "no limit", "0", 0), (3, None, " 4 ", 4)],
)
def test_whole_number_takes_what_it_allows(minimum, zero_means, text, value) -> None:
    assert whole_number(minimum, zero_means)(text) == value


@pytest.mark.parametrize(
    ("minimum", "zero_means", "text", "says"),
    [
        (1, None, "0", "must be >= 1, not 0"),
        (1, None, "-5", "must be >= 1, not -5"),
        (0, "no limit", "-1", "must be >= 0 (0: no limit), not -1"),
        (1, None, "1.5", "'1.5' is not a whole number"),
        (1, None, "ten", "'ten' is not a whole number"),
        (1, None, "", "'' is not a whole number"),
    ],
)
def test_whole_number_refuses_with_the_value(minimum, zero_means, text, says) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as caught:
        whole_number(minimum, zero_means)(text)
    assert str(caught.value) == says


@pytest.mark.parametrize(
    ("zero_means", "text", "value"),
    [(None, "0.5", 0.5), (None, "20", 20.0), ("no limit", "0", 0.0), ("no limit", "3", 3.0)],
)
def test_seconds_takes_finite_times(zero_means, text, value) -> None:
    assert seconds(zero_means=zero_means)(text) == value


@pytest.mark.parametrize(
    ("zero_means", "text", "says"),
    [
        (None, "0", "must be finite and > 0 seconds, not 0"),
        (None, "-1", "must be finite and > 0 seconds, not -1"),
        (None, "nan", "must be finite and > 0 seconds, not nan"),
        (None, "inf", "must be finite and > 0 seconds, not inf"),
        ("no limit", "-0.1", "must be finite and >= 0 (0: no limit), not -0.1"),
        ("no limit", "NaN", "must be finite and >= 0 (0: no limit), not NaN"),
        ("no limit", "-inf", "must be finite and >= 0 (0: no limit), not -inf"),
        (None, "soon", "'soon' is not a number of seconds"),
    ],
)
def test_seconds_refuses_with_the_value(zero_means, text, says) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as caught:
        seconds(zero_means=zero_means)(text)
    assert str(caught.value) == says


def test_argparse_names_the_option_in_front() -> None:
    with pytest.raises(argparse.ArgumentError) as caught:
        _parser(whole_number(1)).parse_args(["--x", "0"])
    assert str(caught.value) == "argument --x: must be >= 1, not 0"
    with pytest.raises(argparse.ArgumentError) as caught:
        _parser(seconds()).parse_args(["--x", "nan"])
    assert str(caught.value) == "argument --x: must be finite and > 0 seconds, not nan"

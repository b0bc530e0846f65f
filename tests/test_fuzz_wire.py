"""The fuzz script itself works, and a short run finds nothing."""

from __future__ import annotations

import json

from tests import fuzz_wire


def test_short_fuzz_run_reports_only_codec_errors(capsys):
    assert fuzz_wire.main(["--iterations", "20000", "--seed", "7", "--quiet"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["other_exception"] == 0 and report["not_canonical"] == 0
    assert report["codec_error"] > 10_000  # the mutations really do break things
    assert report["accepted"] > 0  # and some survive (e.g. a flipped value byte)

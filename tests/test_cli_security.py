"""keygen → authorize → trust → sign → verify, as a user runs them (real processes)."""

from __future__ import annotations

import copy
import json
import os
import stat
import subprocess
import sys
import time

from tests.test_cli import VECTORS


def run(*args: str, stdin: bytes = b"", cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "catsproto", *args],
        input=stdin,
        capture_output=True,
        timeout=60,
        cwd=cwd,
    )


def test_sign_and_verify_end_to_end(tmp_path):
    op, node = tmp_path / "op.key", tmp_path / "node.key"
    assert run("keygen", str(op), "--name", "op").returncode == 0
    out = run("keygen", str(node), "--name", "node")
    assert out.returncode == 0
    assert stat.S_IMODE(os.stat(node).st_mode) == 0o600
    node_pub = json.loads(out.stdout)["public_key"]
    again = run("keygen", str(node))
    assert again.returncode == 2 and b"not overwriting" in again.stderr

    deleg = run(
        "authorize",
        str(op),
        node_pub,
        "--cs-id",
        "100",
        "--route",
        "10.255.0.0/16",
        "--address",
        "192.0.2.0/24",
    )
    assert deleg.returncode == 0, deleg.stderr
    (tmp_path / "deleg.json").write_bytes(deleg.stdout)
    trust = run("trust", "--operator", str(op), "--delegation", str(tmp_path / "deleg.json"))
    assert trust.returncode == 0, trust.stderr
    (tmp_path / "trust.json").write_bytes(trust.stdout)

    # The cache-state example, without its placeholder signature, with a fresh timestamp.
    adv = copy.deepcopy(VECTORS["positive"][2]["json"])
    del adv["signature"]
    adv["timestamp"] = time.time_ns() // 1_000_000
    value = run("encode", stdin=json.dumps(adv).encode())
    assert value.returncode == 0, value.stderr
    signed = run("sign", "--key", str(node), "--route", "10.255.0.11/32", stdin=value.stdout)
    assert signed.returncode == 0, signed.stderr

    ok = run(
        "verify",
        "--trust",
        str(tmp_path / "trust.json"),
        "--route",
        "10.255.0.11/32",
        "--show",
        stdin=signed.stdout,
    )
    assert ok.returncode == 0, ok.stderr
    verdict = json.loads(ok.stdout)
    assert verdict["advertisement"]["origin"]["address"] == "192.0.2.11"

    moved = run(
        "verify",
        "--trust",
        str(tmp_path / "trust.json"),
        "--route",
        "10.255.0.12/32",
        stdin=signed.stdout,
    )
    assert moved.returncode == 1
    assert "bad-signature" in moved.stdout.decode()

    outside = run("sign", "--key", str(node), "--route", "10.0.0.0/33", stdin=value.stdout)
    assert outside.returncode == 2 and len(outside.stderr.decode().splitlines()) == 1


def test_authorize_binds_sites_and_verify_refuses_another_site(tmp_path):
    """`authorize --site` puts site entries in the delegation: the node's advertisement
    naming its own site verifies, one claiming another site's id is not-authorised."""
    op, node = tmp_path / "op.key", tmp_path / "node.key"
    assert run("keygen", str(op)).returncode == 0
    node_pub = json.loads(run("keygen", str(node)).stdout)["public_key"]
    deleg = run(
        "authorize", str(op), node_pub, "--cs-id", "100", "--route", "10.255.0.0/16",
        "--address", "192.0.2.0/24", "--site", "1", "--site", "3",
    )  # fmt: skip
    assert deleg.returncode == 0, deleg.stderr
    assert json.loads(deleg.stdout)["sites"] == [1, 3]
    (tmp_path / "deleg.json").write_bytes(deleg.stdout)
    os.chmod(tmp_path / "deleg.json", 0o644)
    trust = run("trust", "--operator", str(op), "--delegation", str(tmp_path / "deleg.json"))
    assert trust.returncode == 0, trust.stderr
    (tmp_path / "trust.json").write_bytes(trust.stdout)
    os.chmod(tmp_path / "trust.json", 0o644)
    verdicts = {}
    for site in (1, 2):
        adv = copy.deepcopy(VECTORS["positive"][2]["json"])  # the cache-state example
        del adv["signature"]
        adv["origin"]["site_id"] = site
        adv["timestamp"] = time.time_ns() // 1_000_000
        value = run("encode", stdin=json.dumps(adv).encode())
        signed = run("sign", "--key", str(node), "--route", "10.255.0.11/32", stdin=value.stdout)
        assert signed.returncode == 0, signed.stderr
        done = run(
            "verify", "--trust", str(tmp_path / "trust.json"), "--route", "10.255.0.11/32",
            stdin=signed.stdout,
        )  # fmt: skip
        verdicts[site] = (done.returncode, done.stdout.decode())
    assert verdicts[1][0] == 0, verdicts[1]
    assert verdicts[2][0] == 1 and "not-authorised" in verdicts[2][1], verdicts[2]
    bad = run("authorize", str(op), node_pub, "--cs-id", "1", "--route", "10.0.0.0/8",
              "--address", "10.0.0.0/8", "--site", "-1")  # fmt: skip
    assert bad.returncode == 2 and b"--site -1" in bad.stderr, bad.stderr

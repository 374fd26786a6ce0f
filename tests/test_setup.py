"""`make test` on a fresh machine: the services the tests start (redis-server, chromium) come first,
installed from Debian as root, or named in one line otherwise (scripts/services.sh)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "services.sh"


def _fake_bin(tmp_path: Path, uid: int, have: tuple[str, ...] = ()) -> Path:
    """A PATH of stand-ins: `id` prints uid, `apt-get` logs its arguments, and `have` exist."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    log = tmp_path / "apt.log"
    tools = {"id": f"echo {uid}", "apt-get": f'echo "$*" >> {log}'} | {name: "true" for name in have}
    for name, body in tools.items():
        f = bin_ / name
        f.write_text(f"#!/bin/sh\n{body}\n")
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    return bin_


def _run(bin_: Path) -> subprocess.CompletedProcess[str]:
    bash = shutil.which("bash") or "/bin/bash"
    return subprocess.run([bash, str(SCRIPT)], capture_output=True, text=True, env={"PATH": str(bin_)}, timeout=30)


def test_make_test_checks_services_before_installing_and_testing() -> None:
    if shutil.which("make") is None:
        pytest.skip("no make here")
    out = subprocess.run(["make", "-n", "test"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if "scripts/services.sh" in line)
    assert first < next(i for i, line in enumerate(lines) if "pytest" in line)
    assert ".ci/run" not in out and (ROOT / ".ci" / "run").read_text().strip().endswith("make test")


def test_not_root_names_the_command_and_fails(tmp_path: Path) -> None:
    r = _run(_fake_bin(tmp_path, uid=1000))
    assert r.returncode != 0
    assert r.stderr.strip().count("\n") == 0  # one line
    assert "apt-get install -y redis-server chromium" in r.stderr
    assert not (tmp_path / "apt.log").exists()  # nothing installed


def test_root_installs_only_what_is_missing(tmp_path: Path) -> None:
    r = _run(_fake_bin(tmp_path, uid=0, have=("redis-server",)))
    assert r.returncode == 0, r.stderr
    calls = (tmp_path / "apt.log").read_text().splitlines()
    assert calls[0].startswith("update") and calls[-1].endswith("install -y -q chromium")


def test_nothing_to_do_when_both_are_there(tmp_path: Path) -> None:
    r = _run(_fake_bin(tmp_path, uid=1000, have=("redis-server", "chromium")))
    assert r.returncode == 0 and not (tmp_path / "apt.log").exists()
    assert os.access(SCRIPT, os.X_OK)

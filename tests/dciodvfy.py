"""``dciodvfy`` (David Clunie's DICOM validator, Debian package ``dicom3tools``) on the DICOM
objects the tests write: every SEG and SR is checked against its IOD, and any ``Error`` fails the
test that wrote it. Warnings (e.g. the private coding scheme ``99FEDLABELS``, which dciodvfy does
not know though each object declares it) are allowed.

Without the tool installed nothing is checked and a warning says so loudly; the test whose purpose
is the check (``require_dciodvfy``) skips with the reason. ``.ci/run`` installs the tool where it runs
as root with ``apt-get``.
"""

from __future__ import annotations

import shutil
import subprocess
import warnings
from pathlib import Path

import pytest

MISSING = ("dciodvfy not found: the DICOM SEG and SR conformance checks did not run. Install Debian's "
           "dicom3tools (apt-get install dicom3tools; .ci/run does it as root)")


def path() -> str | None:
    return shutil.which("dciodvfy")


def require_dciodvfy() -> str:
    tool = path()
    if tool is None:
        warnings.warn(MISSING, stacklevel=2)
        pytest.skip(MISSING)
    return tool


def errors(dicom_file) -> tuple:
    """(the error lines, the whole report) of ``dciodvfy dicom_file``."""
    proc = subprocess.run([path(), str(dicom_file)], capture_output=True, text=True, timeout=120)
    report = proc.stdout + proc.stderr
    bad = [line for line in report.splitlines() if line.startswith("Error")]
    if proc.returncode != 0 and not bad:
        bad = [f"dciodvfy exit status {proc.returncode}"]
    return bad, report


def check(files) -> list:
    """Assert dciodvfy reports no error on each of ``files``; returns the reports. Without the tool:
    a loud warning, nothing checked."""
    files = [Path(f) for f in files]
    if path() is None:
        warnings.warn(MISSING + f" ({len(files)} object(s) unchecked)", stacklevel=2)
        return []
    reports = []
    for f in files:
        bad, report = errors(f)
        assert not bad, f"dciodvfy {f}:\n{report}"
        reports.append(report)
    return reports

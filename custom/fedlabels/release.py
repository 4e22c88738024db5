"""The release a federation runs: the wheel handed to every participant, and the digest a site reports.

A federation runs one release. The machine that provisions it hands the wheel it runs
(``make dist``; docs/release.md) to every startup kit, so a hospital installs that file and no
other, without a public index; ``check_wheel`` refuses a wheel that is not the version running
here. pip records the sha256 of the file it installed from (``direct_url.json``);
``installed_sha256`` reads it, so two installs of the same version number from different builds
can be told apart. ``code_version`` names the code a result was computed by (a bench cell records it).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import subprocess
import zipfile
from email.parser import HeaderParser
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from . import __version__

NAME = "fedlabels"
WHEEL = re.compile(r"^fedlabels-(?P<version>[^-]+)-py3-none-any\.whl$")
# `git archive` writes the archived commit here (.gitattributes: export-subst); a checkout keeps the placeholder.
ARCHIVED_COMMIT = "$Format:%H$"


def wheel_name(version: str = __version__) -> str:
    return f"{NAME}-{version}-py3-none-any.whl"


def sha256(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_wheel(path, version: str = __version__) -> str:
    """The sha256 of ``path`` when it is the fedlabels wheel of ``version`` (default: the version running
    here); a ``ValueError`` naming the file and what is wrong otherwise."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file (build the release's wheel with `make dist`)")
    match = WHEEL.match(path.name)
    if not match:
        raise ValueError(f"{path}: not a fedlabels wheel (expected a name like {wheel_name(version)})")
    try:
        with zipfile.ZipFile(path) as z:
            meta = z.read(f"{NAME}-{match['version']}.dist-info/METADATA").decode()
    except (zipfile.BadZipFile, KeyError) as e:
        raise ValueError(f"{path}: not a readable wheel ({e})") from None
    headers = HeaderParser().parsestr(meta)
    if headers["Name"] != NAME or headers["Version"] != match["version"]:
        raise ValueError(f"{path}: its METADATA says {headers['Name']} {headers['Version']}, its name "
                         f"{NAME} {match['version']}")
    if headers["Version"] != version:
        raise ValueError(f"{path}: fedlabels {headers['Version']}, but this environment runs fedlabels {version}; "
                         "provision from the environment the federation uses, with its own wheel")
    return sha256(path)


def installed_sha256() -> str | None:
    """The sha256 of the wheel the installed fedlabels came from (pip's ``direct_url.json``); None for an
    editable install, or one from an index (pip records no file there)."""
    try:
        text = distribution(NAME).read_text("direct_url.json")
    except PackageNotFoundError:
        return None
    if not text:
        return None
    info = json.loads(text).get("archive_info") or {}
    return (info.get("hashes") or {}).get("sha256")


@functools.cache  # the code a process runs is fixed once imported: ask git once per process
def code_version() -> str:
    """The code running here, for a result to record: the version and the git commit of the checkout the
    package is imported from ("+modified" when its tracked files under custom/ or bundles/, the code and the
    bundles that train, differ from that commit: a benchmark writing its results into the checkout does not
    count), or the commit a
    ``git archive`` of it was made from; the version alone from an installed wheel.

    Two results of the same settings from different code are different measurements: a finished bench cell
    reused by a later run says which code wrote it (``fedlabels.bench.cells``)."""
    root = Path(__file__).resolve().parents[2]

    def git(*args) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    # only a checkout whose top is this package's root: an install inside another repository's folder
    # (a .venv in a checkout) must not take that repository's commit
    top = git("rev-parse", "--show-toplevel")
    if top and Path(top).resolve() == root:
        commit = git("rev-parse", "HEAD")
        if commit:
            modified = git("status", "--porcelain", "--untracked-files=no", "--", "custom", "bundles")
            return f"{__version__} {commit}{'+modified' if modified else ''}"
    if not ARCHIVED_COMMIT.startswith("$"):
        return f"{__version__} {ARCHIVED_COMMIT}"
    return __version__

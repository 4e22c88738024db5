"""``fedlabels.release.code_version``: the code a result records (a bench cell's ``code``).

Each case imports the real release module from a folder laid out like this checkout (custom/fedlabels/)
in a fresh Python process: a git checkout of its own (its commit, "+modified" once a tracked file
changes), a ``git archive`` of it (the archived commit, written by this repository's .gitattributes),
a copy without git, and a package inside another repository's folder (as a .venv inside a checkout),
which must not take that repository's commit.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from fedlabels import __version__

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "custom" / "fedlabels"

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(root: Path, *args) -> str:
    return subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@example.org", *args],
                          check=True, capture_output=True, text=True).stdout.strip()


def _layout(root: Path) -> Path:
    """root/custom/fedlabels with the real __init__ and release modules, and this repository's .gitattributes."""
    pkg = root / "custom" / "fedlabels"
    pkg.mkdir(parents=True)
    for name in ("__init__.py", "release.py"):
        shutil.copy(PACKAGE / name, pkg / name)
    shutil.copy(REPO / ".gitattributes", root / ".gitattributes")
    return root


def _code_version(root: Path) -> str:
    out = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                          "from fedlabels.release import code_version; print(code_version())",
                          str(root / "custom")], check=True, capture_output=True, text=True, cwd=root)
    return out.stdout.strip()


@pytest.fixture
def checkout(tmp_path):
    root = _layout(tmp_path / "checkout")
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "one")
    return root


def test_a_checkout_names_its_commit_and_a_modified_tree(checkout):
    head = _git(checkout, "rev-parse", "HEAD")
    assert _code_version(checkout) == f"{__version__} {head}"
    (checkout / "custom" / "fedlabels" / "__init__.py").write_text("__version__ = '9.9'\n")
    assert _code_version(checkout) == f"9.9 {head}+modified"
    # an untracked file is not a change to the code that ran, nor is a tracked file outside custom/ and bundles/
    # (a benchmark writes its results into the checkout)
    _git(checkout, "checkout", "--", ".")
    (checkout / "notes.txt").write_text("x")
    assert _code_version(checkout) == f"{__version__} {head}"
    (checkout / ".gitattributes").write_text("changed\n")
    assert _code_version(checkout) == f"{__version__} {head}"


def test_a_git_archive_names_the_archived_commit(checkout, tmp_path):
    head = _git(checkout, "rev-parse", "HEAD")
    data = subprocess.run(["git", "-C", str(checkout), "archive", "--format=tar", "HEAD"], check=True,
                          capture_output=True).stdout
    copy = tmp_path / "copy"
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(copy, filter="data")
    assert _code_version(copy) == f"{__version__} {head}"


def test_a_copy_without_git_names_the_version_only(tmp_path):
    assert _code_version(_layout(tmp_path / "copy")) == __version__


def test_a_package_inside_another_repository_does_not_take_its_commit(tmp_path):
    outer = tmp_path / "outer"
    outer.mkdir()
    _git(outer, "init", "-q")
    (outer / "README").write_text("x")
    _git(outer, "add", "-A")
    _git(outer, "commit", "-q", "-m", "outer")
    # like .venv/lib/python3.11/site-packages/fedlabels inside a checkout
    assert _code_version(_layout(outer / ".venv" / "site")) == __version__

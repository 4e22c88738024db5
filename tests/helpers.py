"""Helpers that more than one test module uses (imported by name: ``from helpers import ...``)."""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import os
import traceback
from pathlib import Path

import pytest
import torch

from fedlabels import cli

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def one_cpu_thread():
    """Tiny images gain nothing from intra-op threads; on a shared 2-core machine two OpenMP
    threads stall whenever another process holds a core. Restored after the module that imports it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def run_cli(argv) -> tuple:
    """(exit code, stdout, stderr) of ``fedlabels ARGV`` run in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main([str(a) for a in argv])
        except SystemExit as e:  # argparse refusals
            code = e.code
    return code, out.getvalue(), err.getvalue()


def one_error_line(result) -> str:
    """The one line a refused command wrote to stderr, from ``(exit code, stdout, stderr)``; fails unless the
    command failed with exactly one line and no traceback."""
    rc, out, err = result
    assert rc != 0, (out, err)
    assert "Traceback" not in out + err, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def cli_in_repo(argv) -> tuple:
    """(exit code, stdout, stderr) of ``fedlabels ARGV`` run through ``cli.main`` in this process, from the
    repository as the subprocesses; an exception escaping ``main`` is written to stderr as the interpreter would."""
    out, err = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main([str(a) for a in argv])
            except SystemExit as e:  # argparse
                code = e.code
            except Exception:
                err.write(traceback.format_exc())
                code = 1
    finally:
        os.chdir(cwd)
    return code, out.getvalue(), err.getvalue()


def read_csv(path: Path) -> list:
    """The rows of a CSV file as dicts."""
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def fedlabels_env() -> dict:
    """The environment of a ``python -m fedlabels.cli`` subprocess: one OpenMP thread, the checkout's package."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(REPO / "custom"), os.environ.get("PYTHONPATH", "")]))


def digest(root) -> str:
    """SHA-256 of every file under ``root``: relative paths and bytes, in sorted order."""
    h = hashlib.sha256()
    for p in sorted(Path(root).rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(root)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def site_context(profile, batches, summary=None, *, labels=None, seed=0):
    """A client rule's ``SiteContext`` over hand-made batches: with ``labels`` (one per training case, as a
    scenario gives them) its summary is their ``label_summary``, else ``summary`` as given."""
    from fedlabels.methods.base import SiteContext
    from fedlabels.profile import label_summary

    if labels is not None:
        summary = label_summary(profile, [{"label": label} for label in labels])
    return SiteContext(profile, batches, summary, seed=seed)


def score_directly(net, weights, bundle, data, config=None) -> dict:
    """``fedlabels.site.evaluate`` of ``weights`` loaded into ``net`` on the test split, without
    ``fedlabels.scoring.Scorer``: what the tests compare the scorer's numbers with."""
    from fedlabels.methods.base import load_weights
    from fedlabels.profile import load_scenario
    from fedlabels.site import evaluate, test_loader

    sc = load_scenario(data, sites=[], with_test=False)
    load_weights(net, weights)
    return evaluate(net, test_loader(bundle, data, config=config), sc.task, sc.classes)


def image(path):
    """Open, decode and close an image (no file handle left open)."""
    from PIL import Image

    with Image.open(path) as im:
        im.load()
        return im


def pixels(path):
    import numpy as np

    return np.asarray(image(path))


# The small real datasets beside the clone (../shared/data) or where FEDLABELS_SHARED_DATA says.
DATA = Path(os.environ.get("FEDLABELS_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


def need(*parts):
    """The real data file or folder under ``DATA``; skips when it is missing, but fails under CI
    (``CI=true``, set by .ci/run), where the data must be there."""
    path = DATA.joinpath(*parts)
    if not path.exists():
        if os.environ.get("CI") == "true":
            pytest.fail(f"real data missing under CI: {path} (place the clone beside shared/ or set "
                        f"FEDLABELS_SHARED_DATA)", pytrace=False)
        pytest.skip(f"real data not available: {path}")
    return path

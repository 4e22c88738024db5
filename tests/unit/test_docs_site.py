"""The documentation site: its pages, and ``mkdocs build --strict`` (a broken link, anchor or API page fails).

The build needs the ``docs`` extra; ``make docs`` (in ``.ci/run``) installs it. Without it the
build test skips here, and the page checks still run.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def _nav_files(nav) -> list:
    out = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        out += _nav_files(value) if isinstance(value, list) else [value]
    return out


def _config() -> dict:
    # mkdocs.yml holds no python tags: a plain YAML read
    return yaml.safe_load((REPO / "mkdocs.yml").read_text())


def test_the_site_has_the_guides_results_and_api_pages():
    cfg = _config()
    nav = _nav_files(cfg["nav"])
    for page in ("getting-started.md", "researcher-guide.md", "deployment.md", "clinical-bundle.md", "datasets.md",
                 "methods/index.md", "methods/baselines.md", "methods/surgical.md", "methods/fedpsl.md",
                 "methods/fedmlp.md", "methods/fedmix.md", "methods/isofed.md", "methods/presets.md",
                 "results/partial-labels.md", "results/fedmlp.md", "results/fedmix.md",
                 "results/isofed.md", "api/methods.md", "api/engine.md", "api/config.md", "api/profile.md",
                 "api/cli.md"):
        assert page in nav, page
    for page in nav:
        assert (REPO / "docs" / page).is_file(), page
    # every page is in the navigation (mkdocs only warns about an omitted one; strict makes it fail)
    on_disk = {str(p.relative_to(REPO / "docs")) for p in (REPO / "docs").rglob("*.md")}
    assert on_disk == set(nav), on_disk ^ set(nav)
    # the API pages document the modules the issue names, through mkdocstrings
    api = {p: (REPO / "docs" / p).read_text() for p in nav if p.startswith("api/")}
    for module in ("fedlabels.methods.base", "fedlabels.engine", "fedlabels.config", "fedlabels.profile",
                   "fedlabels.cli"):
        assert any(f"::: {module}\n" in text for text in api.values()), module
    assert cfg["strict"] is True


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="the docs extra is not installed (make docs)")
def test_mkdocs_build_strict_passes(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for page in ("api/engine/index.html", "results/fedmlp/index.html", "researcher-guide/index.html"):
        assert (tmp_path / "site" / page).is_file(), page
    assert "RoundEngine" in (tmp_path / "site" / "api" / "engine" / "index.html").read_text()

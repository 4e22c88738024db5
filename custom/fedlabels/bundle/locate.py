"""Where bundles are found: by name in ``FEDLABELS_BUNDLES`` and the shipped ones, or by folder.

Imports nothing but the standard library, so that a hospital's gate (fedlabels.flare.gate) and the
presets (fedlabels.presets) can look a bundle up without the training stack.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

# A user's own bundle folders, searched before the shipped ones (os.pathsep-separated):
# a bundle there adds one by its folder's name, or overrides the shipped bundle of that name.
ENV = "FEDLABELS_BUNDLES"


def bundles_dir() -> Path:
    """The bundles this release ships: the package data ``fedlabels/bundles`` of an installed wheel
    (``importlib.resources``), else, in an editable install, the checkout's ``bundles/`` folder."""
    packaged = resources.files("fedlabels") / "bundles"
    if isinstance(packaged, Path) and packaged.is_dir():
        return packaged.resolve()
    return Path(__file__).resolve().parents[3] / "bundles"


def bundle_roots() -> list:
    """Where a bundle is looked up by name, first match first: the folders of ``FEDLABELS_BUNDLES``, then
    the shipped bundles (``bundles_dir``)."""
    return [Path(p).expanduser() for p in os.environ.get(ENV, "").split(os.pathsep) if p] + [bundles_dir()]


def is_bundle(folder) -> bool:
    return (Path(folder) / "configs" / "metadata.json").is_file()


def available() -> dict:
    """Every bundle found by name: name -> folder (a ``FEDLABELS_BUNDLES`` one before a shipped one)."""
    found = {}
    for root in bundle_roots():
        for folder in sorted(root.glob("*")) if root.is_dir() else []:
            if is_bundle(folder):
                found.setdefault(folder.name, folder.resolve())
    return found


def bundle_path(bundle, here=None) -> Path:
    """A bundle folder, or the name of one: looked up in ``here`` (a FLARE job's
    custom folder, where the bundle travels), then in ``bundle_roots()``."""
    path = Path(str(bundle)).expanduser()
    candidates = ([path] + ([Path(here) / path.name] if here is not None else [])
                  + [root / path.name for root in bundle_roots()])
    for c in candidates:
        if is_bundle(c):
            return c.resolve()
    raise FileNotFoundError(f"{bundle}: not a bundle folder (no configs/metadata.json; looked in "
                            f"{[str(c) for c in candidates]}); bundles: {sorted(available())}")

"""Build step: the repository's ``bundles/`` folder becomes the package data ``fedlabels/bundles/``.

``bundles/`` stays where the MONAI commands of the docs expect it (``--bundle_root bundles/<name>``);
a wheel built from the checkout or from the sdist (MANIFEST.in grafts ``bundles/``) carries a copy
inside the package, which ``fedlabels.bundle`` finds with ``importlib.resources``. An editable install
copies nothing: there the lookup falls back to the checkout's ``bundles/``. Metadata: setup.cfg.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
SKIP = shutil.ignore_patterns("__pycache__", "*.py[cod]", ".*")


class BuildPyWithBundles(build_py):
    """``build_py``, then ``bundles/`` copied into the built package as ``fedlabels/bundles``."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        source = HERE / "bundles"
        if not (source / "README.md").is_file():
            raise SystemExit(f"{source}: the MONAI bundles are missing; build from the checkout or its sdist")
        target = Path(self.build_lib) / "fedlabels" / "bundles"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(source, target, ignore=SKIP)


setup(cmdclass={"build_py": BuildPyWithBundles})

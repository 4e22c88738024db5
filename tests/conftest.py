"""Test lanes.

Tests that run the real NVIDIA FLARE simulator or train for minutes carry the
``simulator`` marker (registered in setup.cfg). The unit lane leaves them out::

    pytest -m "not simulator"

Whole modules are marked here by file name, so the modules themselves need no
per-test decorators.
"""

from __future__ import annotations

from pathlib import Path

import pytest

SIMULATOR_MODULES = frozenset({"test_flare.py", "test_claims.py", "test_deploy.py", "test_fedmlp_claims.py",
                               "test_fedmix_flare.py"})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.fspath)).name in SIMULATOR_MODULES:
            item.add_marker(pytest.mark.simulator)

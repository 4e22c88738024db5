"""MONAI bundles: one way to find a bundle, read its configuration and build its network.

* ``data``      -- scenario folders as MONAI datalists, and the bundles' own transforms;
* ``handlers``  -- the Ignite handlers the bundle configs use;
* ``dicom``     -- DICOM inputs by content, and DICOM SEG / structured reports out;
* ``workflows`` -- train / evaluate / export a bundle (``monai.bundle`` underneath).

Every caller (the CLI, a FLARE site, the FLARE server's persistor, the
in-process references, the benchmarks) goes through ``bundle_path``,
``read`` and ``network``, so they all see the same network.
"""

from __future__ import annotations

import logging
import os
import warnings
from importlib import resources
from pathlib import Path


class _OnceNotice(logging.Filter):
    """Lets the first ``text`` record through, drops the later ones."""

    def __init__(self, text: str):
        super().__init__()
        self.text, self.said = text, False

    def filter(self, record: logging.LogRecord) -> bool:
        if self.text not in record.getMessage():
            return True
        said, self.said = self.said, True
        return not said


# Every MONAI LoadImage (several per bundle workflow, so several per bench cell) builds an
# NvImgCodecPydicomReader, which logs and warns that nvImageCodec (GPU DICOM decoding) is missing.
# fedlabels decodes DICOM with pydicom (fedlabels.data.dicom): the notice is said once per process.
logging.getLogger("monai.data.nvimgcodec_pydicom_plugin").addFilter(_OnceNotice("nvImageCodec is not available"))
warnings.filterwarnings("ignore", message="NvImgCodecPydicomReader: nvImageCodec decoder plugin did not register")

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


def read(bundle, dataset_dir="", protocol: str | None = None, **overrides):
    """The bundle's train config (``monai.bundle.ConfigParser``) with ``dataset_dir`` and overrides applied;
    ``protocol``: a preset's override file (``configs/protocols/<protocol>.json``, ``fedlabels.presets``)
    merged over it first, as ``monai.bundle run`` merges a list of config files."""
    from monai.bundle import ConfigParser

    bundle = bundle_path(bundle)
    parser = ConfigParser()
    files = [bundle / "configs" / "train.json"]
    if protocol:
        from ..presets import load

        files.append(load(protocol, bundle).path)
    parser.read_config([str(f) for f in files])
    parser.update({"bundle_root": str(bundle), "dataset_dir": str(dataset_dir), **overrides})
    return parser


def network(bundle, overrides: dict | None = None, parser=None, **config):
    """The bundle's ``network_def`` instantiated, with network overrides (e.g. ``hidden``,
    ``init_ckpt``) applied; ``config`` overrides the config itself (e.g. ``class_names``)."""
    parser = parser or read(bundle, **config)
    for key, value in (overrides or {}).items():
        parser[f"network_def#{key}"] = value
    # The parser's first instantiation builds MONAI's table of components by iterating sys.modules, which
    # raises when another thread imports a module at that moment (an nvflare client process has such
    # threads): a failed build leaves no table behind, so it is tried again.
    for attempt in range(3):
        try:
            return parser.get_parsed_content("network_def", instantiate=True)
        except RuntimeError as exc:
            if "changed size during iteration" not in str(exc) or attempt == 2:
                raise

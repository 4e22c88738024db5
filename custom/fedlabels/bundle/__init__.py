"""MONAI bundles: one way to find a bundle, read its configuration and build its network.

* ``locate``    -- where a bundle is found, by name or folder (standard library only);
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
import warnings

from .locate import ENV, available, bundle_path, bundle_roots, bundles_dir, is_bundle  # noqa: F401 (the package's API)


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

def read(bundle, dataset_dir="", preset: str | None = None, **overrides):
    """The bundle's train config (``monai.bundle.ConfigParser``) with ``dataset_dir`` and overrides applied;
    ``preset``: a preset's override file (``configs/presets/<preset>.json``, ``fedlabels.presets``)
    merged over it first, as ``monai.bundle run`` merges a list of config files."""
    from monai.bundle import ConfigParser

    bundle = bundle_path(bundle)
    parser = ConfigParser()
    files = [bundle / "configs" / "train.json"]
    if preset:
        from ..presets import load

        files.append(load(preset, bundle).path)
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

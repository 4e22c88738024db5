"""The hospital's gate: every configuration-only job is checked against the site's policy before it runs.

A production job carries no code, only ``SiteExecutor``'s arguments (``fedlabels.flare.executor``). Yet
configuration can still act as code: MONAI's config parser evaluates a string that starts with ``$``,
resolves ``@`` and ``%`` references, and instantiates any ``_target_``; a preset or bundle name is a path;
a checkpoint path is unpickled. So the site accepts only what a fedlabels job needs, as plain values:

* ``bundle``: the name of an installed bundle, never a path;
* ``network``: overrides of the network's own arguments (``NETWORK_KEYS``) with numbers, booleans or plain
  words; ``_target_`` only as one of the installed networks (``fedlabels.nets.<Class>``); no checkpoint;
* ``data``: the keys a run uses (``fedlabels.config.DataSpec``); ``preset`` a preset of the installed bundle, by name;
  no ``oracle`` (it trains on labels the hospital does not annotate); no ``data`` executor argument (the
  hospital's scenario folder is its own ``FEDLABELS_DATA``);
* ``client`` / ``server`` options: plain values (the method checks their names and ranges);
* ``faults``: no fault drill at this site unless the site itself allows drills (a test federation);
* classes: only those a fedlabels job names (``ALLOWED``: no log streamer, no other executor).

``check_job`` is the check (no nvflare here; nothing that imports torch or MONAI either, since nvflare runs the
validator in the site's parent process, which answers a deployment within seconds); ``JobGate`` runs it as nvflare's site ``app_validator``
(``local/resources.json``, written by ``fedlabels provision``), so a refused job is never deployed at the
site: the reason, naming the field, is in the site's log and in the job's deployment record the admin
reads (``nvflare job meta``). ``SiteExecutor`` runs the same check again before round 0, for a kit whose
resources.json lacks the validator.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from nvflare.apis.app_validation import AppValidator

EXECUTOR = "fedlabels.flare.executor.SiteExecutor"
# Every class a production job's configuration may name, and nothing else: each kit's class allow list
# (fedlabels.flare.provision replaces nvflare's default list, about 90 classes, with it) and this gate. Our
# controller, site executor and audit filter, the networks of our bundles (the server's persistor builds one),
# nvflare's PyTorch persistor and model locator, the filter that keeps a site's batch norm (FedBN) and the
# quantization filters (half-precision transfer). Prefixes, as nvflare matches them.
ALLOWED = ("fedlabels.flare.controller.FedLabelsController", EXECUTOR, "fedlabels.flare.sent.SentRecord",
           "fedlabels.nets", "nvflare.app_opt.pt.file_model_persistor.PTFileModelPersistor",
           "nvflare.app_opt.pt.file_model_locator.PTFileModelLocator", "nvflare.app_opt.pt.quantization",
           "nvflare.app_common.filters.exclude_vars.ExcludeVars")
# The networks' own arguments a job may override (fedlabels.nets; tests/unit/test_gate.py keeps this list equal
# to the constructors' signatures less init_ckpt, which names a file the site would unpickle).
NETWORK_KEYS = ("spatial_dims", "in_channels", "out_channels", "hidden", "dropout", "widen_factor", "features",
                "num_groups", "output")
NETWORK_TARGET = re.compile(r"fedlabels\.nets\.[A-Z][A-Za-z0-9]*")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_+.-]*")  # a plain word: no $, @ or % (MONAI evaluates those), no path


class GateError(ValueError):
    """A job the site refuses; the message names the field."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"refused by the site's gate: field {field!r}: {message}")


def _plain(value, field: str, words: bool = True) -> None:
    """A number, a boolean, None, a plain word, or a flat list of those: nothing a parser evaluates."""
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            if isinstance(v, (list, tuple, dict)):
                raise GateError(f"{field}[{i}]", "a nested value; only numbers, booleans and plain words")
            _plain(v, f"{field}[{i}]", words)
        return
    if value is None or isinstance(value, (bool, int, float)):
        return
    if isinstance(value, str):
        if words and WORD.fullmatch(value):
            return
        raise GateError(field, f"{value[:60]!r} is not a plain word (a string starting with $, @ or % is code "
                               "to MONAI's parser; a path names files at the site)")
    raise GateError(field, f"a {type(value).__name__}; only numbers, booleans and plain words")


def installed_bundle(name) -> Path:
    """The folder of the installed bundle ``name`` (the release's, or the hospital's own in FEDLABELS_BUNDLES)."""
    from ..bundle import available

    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise GateError("bundle", f"{str(name)[:60]!r} is not a bundle name (a job names an installed bundle, "
                                  "never a path)")
    have = available()
    if name not in have:
        raise GateError("bundle", f"{name!r} is not installed at this site (installed: {sorted(have)})")
    return have[name]


def check_job(config, site: str, data: str = "", fault_drills: bool = False) -> None:
    """Raise ``GateError`` naming the field when the site must refuse a job whose ``SiteExecutor`` takes
    ``config`` (the run configuration's JSON) and ``data``; ``site``: this site's name (fault drills are
    refused where they name it, unless ``fault_drills``)."""
    if data:
        raise GateError("data", "a job cannot choose the hospital's data: the site trains on its own "
                                "FEDLABELS_DATA")
    if not isinstance(config, dict):
        raise GateError("config", f"a {type(config).__name__}, not the run configuration")
    from ..config import ConfigError, RunConfig

    try:
        cfg = RunConfig.from_json(dict(config), "job")
    except ConfigError as e:  # a data entry by its own name (the data section is where a job names what to train on)
        raise GateError(e.field if e.field.startswith("data.") else "config", str(e)) from None
    bundle = installed_bundle(cfg.bundle)
    _plain(cfg.method, "method")
    for key, value in cfg.network.items():
        if key == "_target_":
            if not isinstance(value, str) or not NETWORK_TARGET.fullmatch(value):
                raise GateError("network._target_", f"{str(value)[:60]!r} is not one of the installed networks "
                                                    "(fedlabels.nets.<Class>)")
            continue
        if key not in NETWORK_KEYS:
            raise GateError(f"network.{key}", f"not a network argument a job may set ({list(NETWORK_KEYS)})")
        _plain(value, f"network.{key}")
    data = cfg.data  # its keys and types are checked by the parser (fedlabels.config.DataSpec)
    if data.oracle:
        raise GateError("data.oracle", "trains on labels the hospital does not annotate (an upper bound for "
                                       "benchmarks, never a hospital's run)")
    for key, value in data.synth.items():
        _plain(value, f"data.synth.{key}", words=False)
    _plain(data.family, "data.family")
    preset = data.preset
    if preset is not None:
        if not isinstance(preset, str) or not NAME.fullmatch(preset) \
                or not (bundle / "configs" / "presets" / f"{preset}.json").is_file():
            raise GateError("data.preset", f"{str(preset)[:60]!r} is not a preset of the installed bundle "
                                             f"{bundle.name}")
    for side in ("client", "server"):
        for key, value in getattr(cfg, side).items():
            _plain(value, f"{side}.{key}")
    for i, fault in enumerate(cfg.faults):
        if not isinstance(fault, str) or fault.count(":") != 2:
            raise GateError(f"faults[{i}]", f"{str(fault)[:60]!r} is not SITE:KIND:ROUND")
        if fault.split(":")[0] == site and not fault_drills:
            raise GateError(f"faults[{i}]", f"a fault drill at {site}; this site allows none (fedlabels provision "
                                            "--fault-drills enables them for a test federation)")


def _classes(node, where: str):
    """(config path, class path) of every component a job configuration names (``path`` keys)."""
    if isinstance(node, dict):
        if isinstance(node.get("path"), str):
            yield where, node["path"]
        for key, value in node.items():
            yield from _classes(value, f"{where}.{key}" if where else key)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _classes(value, f"{where}[{i}]")


def check_client_config(doc, site: str, fault_drills: bool = False) -> None:
    """``check_job`` for every ``SiteExecutor`` in a job's ``config_fed_client.json`` (its parsed JSON), and
    every class it names one of those a fedlabels job uses (``ALLOWED``: no log streamer, no other
    executor); the kit's class allow list enforces the same when the job starts, this says why first."""
    if not isinstance(doc, dict):
        raise GateError("config_fed_client.json", "not a JSON object")
    for where, path in _classes(doc, ""):
        if not any(path == a or path.startswith(a + ".") for a in ALLOWED):
            raise GateError(where, f"{path[:80]!r} is not a class a fedlabels job uses ({list(ALLOWED)})")
    for i, entry in enumerate(doc.get("executors") or []):
        executor = entry.get("executor") if isinstance(entry, dict) else None
        if not isinstance(executor, dict) or executor.get("path") != EXECUTOR:
            continue
        args = executor.get("args") or {}
        if not isinstance(args, dict):
            raise GateError(f"executors[{i}].executor.args", "not a mapping")
        unknown = sorted(set(args) - {"config", "data"})
        if unknown:
            raise GateError(f"executors[{i}].executor.args.{unknown[0]}", "not an argument of SiteExecutor")
        check_job(args.get("config"), site, args.get("data", ""), fault_drills)


class JobGate(AppValidator):
    """nvflare's site ``app_validator``: a job whose client configuration fails ``check_job`` is not deployed.

    Args:
        site: this site's name (fault drills are refused where they name it).
        fault_drills: whether this site accepts fault drills (a test federation's sites only).
    """

    def __init__(self, site: str, fault_drills: bool = False):
        super().__init__()
        self.site, self.fault_drills = site, bool(fault_drills)

    def validate(self, app_folder: str) -> tuple:
        path = Path(app_folder) / "config" / "config_fed_client.json"
        if not path.is_file():
            return "", {}  # a server app, or a job form nvflare's own validator already refuses
        if (Path(app_folder) / "custom").exists():
            return "", {}  # a job with code: nvflare's BYOC right decides (refused where --no-byoc)
        try:
            check_client_config(json.loads(path.read_text()), self.site, self.fault_drills)
        except (GateError, ValueError) as e:
            message = f"fedlabels gate at {self.site}: {e}"
            # the site's own log (nvflare returns the message to the server, which records it in the job)
            logging.getLogger(__name__).error(f"job app {Path(app_folder).name} not deployed: {message}")
            return message, {}
        return "", {}


def site_gate(here) -> dict:
    """The gate's arguments in the kit's ``local/resources.json`` (``app_validator``), or {} when the kit has
    none. ``here``: a provisioned job's custom folder (``<kit>/<job>/app_<site>/custom``)."""
    path = Path(here).resolve().parents[2] / "local" / "resources.json"
    try:
        validator = json.loads(path.read_text()).get("app_validator") or {}
    except (OSError, ValueError, AttributeError):
        return {}
    if not isinstance(validator, dict) or validator.get("path") != f"{__name__}.JobGate":
        return {}
    args = validator.get("args")
    return args if isinstance(args, dict) else {}

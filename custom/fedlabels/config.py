"""One typed configuration per run, read by the server and by every site.

A job carries it as ``fedlabels.json`` (JSON keeps types: ``5e-05`` stays a
float). Both sides call ``RunConfig.load`` and ``validate`` before round 0;
a wrong field fails with the file and field named.

    {"method": "surgical", "bundle": "cxr_densenet121",
     "client": {"lr": 0.001, "warmup_epochs": 3}, "server": {"weighted": false},
     "network": {"out_channels": 6}, "data": {"family": "cxr", "synth": {"cases": 40}, "batch_size": null},
     "seed": 0, "key_metric": null, "min_sites": 1, "transfer": "float32",
     "privacy": {"noise_multiplier": 1.0, "clip": 6.0, "delta": 1e-05}}

``privacy`` (empty or absent: off) noises the label summary each site shares
(``fedlabels.privacy``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from .profile import write_json_atomic

FILE = "fedlabels.json"

# The validation metric that picks the best model, per task (mean over sites).
KEY_METRICS = {"multilabel": "val_auroc", "multiclass": "val_accuracy", "segmentation": "val_dice"}
# Precision of the weights sent each way (float16: nvflare's ModelQuantizer/ModelDequantizer filters).
TRANSFERS = ("float32", "float16")
# Seconds the server waits for a site's answer to one task (a round's training, the handshake, the final
# evaluation) before it leaves the site out of that step and goes on: a hung site cannot stall the
# federation. An hour fits a round of the shipped jobs on a CPU-only site; set it per job (job.py
# --site-timeout) to a few times the slowest site's round. Unset (None), it applies to deployments
# (POC, provisioned) only: in the simulator, with fewer worker threads than sites, a site waits for its
# turn without having hung, so the simulator waits unless the job sets the option.
DEFAULT_SITE_TIMEOUT = 3600


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1. A count of 0 (sites, rounds, cases) would otherwise fall through
    an ``if value:`` to the default and mean something the user did not ask for."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {value}")
    return value


class ConfigError(ValueError):
    def __init__(self, path, field_name, message):
        self.field = field_name
        super().__init__(f"{path}: field {field_name!r}: {message}")


@dataclass
class DataSpec:
    """What a run trains on, beyond the site's own scenario (a site with ``FEDLABELS_DATA`` trains on that;
    one without generates the embedded ``family`` with ``synth``'s options)."""

    family: str = "cxr"                          # the embedded scenario (fedlabels.data.synthetic.FAMILIES)
    synth: dict = field(default_factory=dict)    # the embedded scenario's options (cases, size, ...)
    batch_size: int | None = None                # None: the bundle's
    oracle: bool = False                         # sites train on their full labels (oracle.json): an upper bound
    image_size: int | None = None                # the bundle's input size (None: the bundle's own)
    preset: str | None = None                    # a paper's preset merged over the bundle's config (fedlabels.presets)

    def __post_init__(self):
        self.synth = dict(self.synth)  # its own copy (see RunConfig.__post_init__)

    def to_json(self) -> dict:
        # the optional entries only when set: configurations written without them stay as they were
        return {"family": self.family, "synth": dict(self.synth), "batch_size": self.batch_size,
                **({"oracle": True} if self.oracle else {}),
                **({"image_size": self.image_size} if self.image_size is not None else {}),
                **({"preset": self.preset} if self.preset else {})}

    @classmethod
    def from_json(cls, doc, path="<config>") -> "DataSpec":
        if isinstance(doc, cls):
            return doc
        if not isinstance(doc, dict):
            raise ConfigError(path, "data", f"expected an object, got {type(doc).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        for key in doc:
            if key not in known:
                raise ConfigError(path, f"data.{key}", f"unknown; a run's data section holds {known}")
        checks = {"family": (str,), "synth": (dict,), "oracle": (bool,)}
        for key, types in checks.items():
            if key in doc and not isinstance(doc[key], types):
                raise ConfigError(path, f"data.{key}", f"expected {types[0].__name__}, got {type(doc[key]).__name__}")
        for key, least, unit in (("batch_size", 1, "cases"), ("image_size", 8, "pixels")):  # never a word a site passes on
            value = doc.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
                raise ConfigError(path, f"data.{key}", f"expected an integer >= {least} ({unit}) or null, "
                                                       f"not {str(value)[:60]!r}")
        preset = doc.get("preset")
        if preset is not None and (not isinstance(preset, str) or not preset):
            raise ConfigError(path, "data.preset", f"expected a preset name (fedlabels.presets), not {str(preset)[:60]!r}")
        return cls(**doc)


@dataclass
class RunConfig:
    method: str
    bundle: str = "cxr_densenet121"
    client: dict = field(default_factory=dict)   # the client rule's named options
    server: dict = field(default_factory=dict)   # the server rule's named options
    network: dict = field(default_factory=dict)  # the bundle's network_def overrides
    data: DataSpec = field(default_factory=DataSpec)  # what the sites train on (a dict is read as one)
    seed: int = 0
    key_metric: str | None = None                # None: the task's default (KEY_METRICS)
    min_sites: int = 1
    faults: list = field(default_factory=list)   # fault drills "SITE:KIND:ROUND" (flare/client.py)
    transfer: str = "float32"                    # weights on the wire; "float16": nvflare's quantization filters
    privacy: dict = field(default_factory=dict)  # noise_multiplier, clip, delta: the label summary leaves noised
    site_timeout: int | None = None              # seconds a site has to answer a task before it is left out

    def __post_init__(self):
        self.data = DataSpec.from_json(self.data)
        # its own copies: a run made from another (dataclasses.replace, JobSpec.replace) shares no dict with it
        self.client, self.server, self.network = dict(self.client), dict(self.server), dict(self.network)
        self.faults, self.privacy = list(self.faults), dict(self.privacy)

    def to_json(self) -> dict:
        doc = {**dataclasses.asdict(self), "data": self.data.to_json()}
        if not doc["privacy"]:
            del doc["privacy"]  # off is left out: configurations written before the option stay as they were
        if doc["site_timeout"] is None:
            del doc["site_timeout"]  # likewise
        return doc

    def save(self, path) -> Path:
        path = Path(path)
        write_json_atomic(path, self.to_json())
        return path

    @classmethod
    def load(cls, path) -> "RunConfig":
        path = Path(path)
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: the run configuration is missing") from None
        except json.JSONDecodeError as e:
            raise ConfigError(path, "(file)", f"not valid JSON: {e}") from None
        return cls.from_json(doc, path)

    @classmethod
    def from_json(cls, doc: dict, path="<config>") -> "RunConfig":
        if not isinstance(doc, dict):
            raise ConfigError(path, "(file)", "expected a JSON object")
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(doc) - set(known))
        if unknown:
            raise ConfigError(path, unknown[0], f"unknown field; fields are {sorted(known)}")
        if "method" not in doc:
            raise ConfigError(path, "method", "missing")
        types = {"method": str, "bundle": str, "client": dict, "server": dict, "network": dict,
                 "seed": int, "min_sites": int, "faults": list, "transfer": str, "privacy": dict}
        for name, typ in types.items():
            if name in doc and not isinstance(doc[name], typ) or isinstance(doc.get(name), bool) and typ is int:
                raise ConfigError(path, name, f"expected {typ.__name__}, got {type(doc[name]).__name__}")
        timeout = doc.get("site_timeout")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int)):
            raise ConfigError(path, "site_timeout",
                              f"expected an integer (seconds) or null, got {type(timeout).__name__}")
        if doc.get("key_metric") is not None and not isinstance(doc["key_metric"], str):
            raise ConfigError(path, "key_metric", "expected a string or null")
        cfg = cls(**{**doc, "data": DataSpec.from_json(doc.get("data", {}), path)})
        cfg._path = str(path)
        return cfg

    def validate(self, side: str) -> None:
        """Check the method and the options of ``side`` ("server" or "client") by name."""
        from . import methods

        path = getattr(self, "_path", "<config>")
        if side not in ("server", "client"):
            raise ValueError(f"side must be 'server' or 'client', not {side!r}")
        try:
            method = methods.get(self.method)
        except ValueError as e:
            raise ConfigError(path, "method", str(e)) from None
        try:
            if side == "server":
                method.server_options(**self.server)
            else:
                method.client_options(**self.client)
        except ValueError as e:
            raise ConfigError(path, side, str(e)) from None
        if self.min_sites < 1:
            raise ConfigError(path, "min_sites", "must be >= 1")
        if self.site_timeout is not None and self.site_timeout < 1:
            raise ConfigError(path, "site_timeout", "must be >= 1 (seconds a site has to answer a task)")
        DataSpec.from_json(dataclasses.asdict(self.data), path)  # set in code after loading: checked again
        if self.transfer not in TRANSFERS:
            raise ConfigError(path, "transfer", f"must be one of {TRANSFERS}, not {self.transfer!r}")
        if self.privacy:
            from . import privacy

            try:
                privacy.options(self.privacy)
            except privacy.OptionError as e:
                raise ConfigError(path, f"privacy.{e.key}" if e.key else "privacy", str(e)) from None

    def metric(self, task: str) -> str:
        return self.key_metric or KEY_METRICS[task]

    def bundle_config(self) -> dict:
        """Overrides of the bundle's config this run trains with (``preset``: a preset's override file,
        ``image_size``)."""
        size, preset = self.data.image_size, self.data.preset
        return {**({"preset": preset} if preset else {}), **({} if size is None else {"image_size": int(size)})}

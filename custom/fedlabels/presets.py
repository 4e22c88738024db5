"""Each paper's protocol as a named preset: one MONAI config override file per bundle.

A preset is ``bundles/<bundle>/configs/presets/<name>.json``, merged over the
bundle's ``configs/train.json`` the way MONAI merges config files (keys with
``#`` reach into nested entries), so ``python -m monai.bundle run --config_file
"['configs/train.json','configs/presets/isofed.json']"`` trains with it too.
Besides the bundle keys (input size and intensity scaling, augmentations,
network, batch size) it holds a ``federated`` section (rounds, local epochs,
the client's optimizer and whether it is re-created every round; ``options``:
method options, each given to every row whose client or server rule takes an
option of that name) and a ``sources`` section saying where each value comes
from (the paper, its released code, or a stated choice); docs/methods/presets.md lists
them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

# preset -> the bundle that holds it (the paper's network)
PRESETS = {"isofed": "medmnist_cnn", "isofed_rscfed": "medmnist_cnn", "fedmix": "lesion_unet", "surgical": "cxr_densenet121",
           "fedpsl": "cxr_densenet121", "fedmlp": "cxr_resnet18", "cxr": "cxr_resnet18",
           "fedmlp_blood": "cxr_resnet18"}
# what a preset's federated.client section may set (every ClientRule takes these)
CLIENT_KEYS = ("optimizer", "lr", "weight_decay", "reset_optimizer", "momentum", "clip_grad_norm")


@dataclass
class Preset:
    name: str
    bundle: Path
    path: Path
    rounds: int
    local_epochs: int
    client: dict = field(default_factory=dict)
    batch_size: int | None = None
    sources: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict)  # method option -> value, for the rows whose rules take it

    def rule_options(self, method) -> dict:
        """The options this preset gives a registered method (``fedlabels.methods.Method``): the client
        settings and the local epochs to its client rule, each method option to the side of the rule that
        takes it (a supervised row has no ``lr_unlabeled``). ``fedlabels bench --preset`` and a job with a
        ``preset`` both start from these; their own options override them."""
        client, server = {**self.client, "epochs": self.local_epochs}, {}
        for key, value in self.options.items():
            if key in method.client_option_names():
                client[key] = value
            elif key in method.server_option_names():
                server[key] = value
        return {"client": client, "server": server}


def preset_file(bundle, name: str) -> Path:
    return Path(bundle) / "configs" / "presets" / f"{name}.json"


def load(name: str, bundle=None) -> Preset:
    """The preset ``name`` (of ``bundle``, else of its paper's bundle), checked: one error naming file and field."""
    from .bundle.locate import bundle_path

    if bundle is None:
        if name not in PRESETS:
            raise ValueError(f"--preset {name!r}: unknown preset; presets: {sorted(PRESETS)}")
        bundle = PRESETS[name]
    bundle = bundle_path(bundle)
    path = preset_file(bundle, name)
    if not path.is_file():
        have = sorted(p.stem for p in (bundle / "configs" / "presets").glob("*.json"))
        raise ValueError(f"--preset {name!r}: bundle {bundle.name} has no {path.relative_to(bundle)} "
                         f"(its presets: {have or 'none'})")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    fed = data.get("federated")
    if not isinstance(fed, dict):
        raise ValueError(f"{path}: field 'federated': expected an object with rounds, local_epochs and client")
    for key in ("rounds", "local_epochs"):
        if not isinstance(fed.get(key), int) or fed[key] < 1:
            raise ValueError(f"{path}: field 'federated.{key}': expected a positive integer, got {fed.get(key)!r}")
    client = fed.get("client", {})
    unknown = sorted(set(client) - set(CLIENT_KEYS))
    if unknown:
        raise ValueError(f"{path}: field 'federated.client': unknown key(s) {unknown}; allowed: {list(CLIENT_KEYS)}")
    options = fed.get("options", {})
    if not isinstance(options, dict):
        raise ValueError(f"{path}: field 'federated.options': expected an object of method options")
    if options:
        from . import methods

        known = set()
        for m in methods.names():
            rule = methods.get(m)
            known |= rule.client_option_names() | rule.server_option_names()
        unknown = sorted(set(options) - known)
        if unknown:  # a typo would otherwise reach no row and change nothing
            raise ValueError(f"{path}: field 'federated.options': {unknown} is no registered method's option")
        clash = sorted(set(options) & set(CLIENT_KEYS))
        if clash:
            raise ValueError(f"{path}: field 'federated.options': {clash} belong in 'federated.client'")
    batch = data.get("batch_size")
    return Preset(name, bundle, path, fed["rounds"], fed["local_epochs"], dict(client),
                  batch if isinstance(batch, int) else None, dict(data.get("sources", {})), dict(options))

"""Bundles in, checkpoints and deployable bundles out.

Three entry points the CLI (and the FLARE side) call, each a thin layer over
MONAI's own bundle machinery -- ``monai.bundle.ConfigWorkflow`` runs the
bundle's configs, ``monai.bundle.ckpt_export`` writes the TorchScript model:

* ``train_bundle``    -- ``configs/train.json`` on a scenario (one site, a few,
  or all pooled = centralised; ``oracle=True`` = full labels);
* ``evaluate_bundle`` -- ``configs/train.json`` + ``configs/evaluate.json`` on
  the test split or a site's validation split -> metrics dict (+ JSON);
* ``export_bundle``   -- a checkpoint (a training checkpoint ``{"model": sd}``
  or a plain state dict, e.g. FLARE's global model, tensors or NumPy arrays)
  -> a self-contained bundle folder with ``models/model.pt`` and
  ``models/model.ts`` that ``python -m monai.bundle run --config_file
  configs/inference.json`` runs on new images.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from . import bundle_path
from ..run import Run
from ..checkpoint import load_state_dict, torch_load  # noqa: F401 (part of this module's API)

logger = logging.getLogger("fedlabels.bundle")

BUNDLE_FILES = ("configs", "docs", "LICENSE")


def _config(bundle: Path, *names: str) -> list:
    files = [str(bundle / "configs" / n) for n in names]
    for f in files:
        if not os.path.isfile(f):
            raise FileNotFoundError(f"{f}: missing bundle config")
    return files


def _workflow(bundle: Path, configs: list, workflow_type, **overrides):
    from monai.bundle import ConfigWorkflow

    return ConfigWorkflow(
        config_file=configs,
        meta_file=str(bundle / "configs" / "metadata.json"),
        logging_file=str(bundle / "configs" / "logging.conf"),
        workflow_type=workflow_type,
        **overrides,
    )


def check_scenario(data) -> None:
    """Validate scenario folder ``data`` (``profile.load_scenario``) before MONAI parses a config.

    The bundles read the scenario inside ``ConfigExpression``s, and MONAI's
    ConfigParser wraps whatever they raise in a long chained traceback; checked
    here, a malformed scenario is one ``ScenarioError`` naming file and field.
    """
    from ..profile import load_scenario

    load_scenario(data)


def _clean(overrides: dict) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in overrides.items() if v is not None}


# ------------------------------------------------------------------ train


def train_bundle(bundle, data, out, site=None, epochs: int | None = None, oracle: bool = False, **overrides) -> Path:
    """Train ``bundle`` on scenario ``data``; checkpoints and TensorBoard logs go under ``out``.

    ``site=None`` pools every site (centralised); a name (or ``"a,b"``)
    trains on those sites only. ``overrides`` are bundle config ids, e.g.
    ``batch_size=8, image_size=32, lr=1e-4, num_workers=1``.

    Returns the best checkpoint by the validation key metric
    (``out/models/model.pt``), or the final one (``model_final.pt``) when the
    key metric was never defined. ``out/train_summary.json`` records the run.
    """
    bundle = bundle_path(bundle)
    check_scenario(data)
    out = Path(out).resolve()
    ckpt_dir = out / "models"
    args = _clean({
        "bundle_root": str(bundle),
        "dataset_dir": str(Path(data).resolve()),
        "site": site or "",
        "oracle": bool(oracle),
        "epochs": epochs,
        "output_dir": str(out),
        "ckpt_dir": str(ckpt_dir),
        **overrides,
    })
    wf = _workflow(bundle, _config(bundle, "train.json"), "train", **args)
    wf.initialize()
    missing = wf.check_properties()
    if missing:
        raise ValueError(f"{bundle}/configs/train.json lacks MONAI bundle properties {missing}")
    t0 = time.perf_counter()
    logger.info(f"training {bundle.name} on {data} (site: {site or 'all, pooled'}, oracle: {oracle}) -> {out}")
    wf.run()
    trainer = wf.trainer
    evaluator = wf.parser.get_parsed_content("validate#evaluator")
    n_train = len(wf.parser.get_parsed_content("train#dataset"))
    n_val = len(wf.parser.get_parsed_content("validate#dataset"))
    wf.finalize()
    best, final = ckpt_dir / "model.pt", ckpt_dir / "model_final.pt"
    ckpt = best if best.is_file() else final
    summary = {
        "bundle": bundle.name,
        "dataset_dir": args["dataset_dir"],
        "site": site or None,
        "oracle": bool(oracle),
        "train_cases": n_train,
        "validation_cases": n_val,
        "epochs": int(trainer.state.max_epochs),
        "iterations": int(trainer.state.iteration),
        "seconds": round(time.perf_counter() - t0, 2),
        "key_metric": evaluator.state.key_metric_name,
        "best_metric": _num(evaluator.state.best_metric),
        "best_metric_epoch": int(evaluator.state.best_metric_epoch),
        "last_metrics": {k: _num(v) for k, v in evaluator.state.metrics.items() if not isinstance(v, dict)},
        "checkpoint": str(ckpt),
        "overrides": {k: v for k, v in overrides.items() if isinstance(v, (str, int, float, bool, list))},
    }
    _write_json(out / "train_summary.json", summary)
    logger.info(f"trained {bundle.name}: best {summary['key_metric']} {summary['best_metric']} at epoch "
                f"{summary['best_metric_epoch']}; checkpoint {ckpt}")
    return ckpt


def _num(v):
    try:
        v = float(v)
    except (TypeError, ValueError):
        return None
    return None if np.isnan(v) else v


def _write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


# --------------------------------------------------------------- evaluate


def evaluate_bundle(bundle, ckpt, data, out=None, split: str = "test", site=None, oracle: bool = False,
                    **overrides) -> dict:
    """Evaluate checkpoint ``ckpt`` with the bundle's metrics; returns the metrics dict.

    ``split``: ``"test"`` (the scenario's held-out, fully labeled test set),
    a site name (that site's validation split, scored only on the classes it
    annotates), or ``"validation"`` (the validation splits of ``site``, or of
    every site pooled). The result is also written to ``out/metrics.json``
    (``out`` defaults to a temporary folder that is removed).
    """
    bundle = bundle_path(bundle)
    check_scenario(data)
    given = ckpt
    ckpt = _as_state_dict_file(ckpt)
    converted = not (isinstance(given, (str, os.PathLike)) and Path(given).resolve() == ckpt)
    if split in ("test", "testing"):
        eval_split = "test"
    elif split in ("validation", "training"):
        eval_split = split
    else:  # a site name: that site's validation split
        eval_split, site = "validation", split
    tmp = None
    if out is None:
        tmp = tempfile.mkdtemp(prefix="fedlabels-eval-")
        out = tmp
    out = Path(out).resolve()
    args = _clean({
        "bundle_root": str(bundle),
        "dataset_dir": str(Path(data).resolve()),
        "site": site or "",
        "oracle": bool(oracle),
        "eval_split": eval_split,
        "ckpt_path": str(ckpt),
        "output_dir": str(out),
        **overrides,
    })
    try:
        wf = _workflow(bundle, _config(bundle, "train.json", "evaluate.json"), None, **args)
        wf.initialize()
        logger.info(f"evaluating {ckpt} with {bundle.name} on {data} ({eval_split}{', site ' + site if site else ''})")
        wf.run()
        wf.finalize()
        result = json.loads((out / "metrics.json").read_text())
        if converted:  # name what the caller gave, not the temporary conversion
            result["checkpoint"] = str(given) if isinstance(given, (str, os.PathLike)) else "<in-memory state dict>"
            _write_json(out / "metrics.json", result)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if converted:
            ckpt.unlink(missing_ok=True)
    shown = ", ".join(f"{k} {v:.4f}" for k, v in result["metrics"].items() if isinstance(v, float))
    logger.info(f"{bundle.name} on {eval_split}{' of ' + site if site else ''}: {shown}")
    return result


# ------------------------------------------------------------------ export


def _as_state_dict_file(ckpt) -> Path:
    """Checkpoints the bundle's CheckpointLoader can read: keep files, save objects."""
    if isinstance(ckpt, (str, os.PathLike)):
        path = Path(ckpt).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"{path}: checkpoint not found")
        obj = torch_load(path)
        if isinstance(obj, dict) and any(isinstance(v, np.ndarray) for v in obj.values()):
            ckpt = obj  # NumPy arrays (FLARE): convert below
        else:
            return path
    fd, tmp = tempfile.mkstemp(suffix=".pt", prefix="fedlabels-ckpt-")
    os.close(fd)
    torch.save(load_state_dict(ckpt), tmp)
    return Path(tmp)


def _inference_parser(bundle: Path, **overrides):
    from monai.bundle import ConfigParser

    parser = ConfigParser()
    parser.read_config(str(bundle / "configs" / "inference.json"))
    parser.read_meta(str(bundle / "configs" / "metadata.json"))
    parser.update({"bundle_root": str(bundle), **overrides})
    return parser


def _scenario_window(data):
    """The ``dicom_window`` of scenario folder ``data`` (``fedlabels import --window``, ``prepare ich``), or None."""
    import yaml

    path = Path(data) / "scenario.yaml"
    try:
        meta = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return None
    window = meta.get("dicom_window") if isinstance(meta, dict) else None
    if window is not None:
        from ..data.dicom import DicomError, parse_window

        try:
            parse_window(window)
        except DicomError as e:
            raise ValueError(f"{path}: field 'dicom_window': {e}") from None
    return window


def export_bundle(bundle, ckpt, out, class_names=None, image_size: int | None = None, metrics: dict | None = None,
                  provenance: dict | None = None, check: bool = True, data=None, run=None, site_state=None,
                  network: dict | None = None, twin: str = "first") -> Path:
    """Write a deployable copy of ``bundle`` at ``out`` with the weights of ``ckpt``.

    * ``models/model.pt`` -- the plain state dict (MONAI bundle spec);
    * ``models/model.ts`` -- TorchScript by ``monai.bundle.ckpt_export`` from
      ``configs/inference.json`` (metadata and configs embedded);
    * ``configs/metadata.json`` -- class names (``channel_def``, ``class_names``),
      input size, optional ``eval_metrics`` and ``provenance``;
    * with ``data`` (a scenario folder): the decision thresholds chosen on its
      sites' validation cases, the test metrics per class with confidence
      intervals, the sites' label table (``bundle.card``) in the metadata, and
      the model card ``docs/README.md`` written from them;
    * with ``run`` (a federated run's server folder): the method, the rounds
      completed and which model (best or last) in the provenance;
    * with ``site_state`` (a FedBN site's state folder ``fedlabels_state/<run>/<site>``, its last
      saved round, or one ``round-NNNNN.pt`` in it): the
      site's own batch norm replaces the global model's, which no site trained
      (``methods.base.personal_model``);
    * a FedMix model (``nets.TwinUNet``: F1 and F2 in one state dict) ships F1 as the bundle's
      plain UNet (``twin="first"``), or both with their mean probability (``twin="mean"``; the
      inference network is then ``fedlabels.nets.TwinUNet``, twice the compute).

    ``class_names`` / ``image_size`` / ``network`` (network options, e.g.
    ``widen_factor``) override the bundle's defaults (a scenario with other
    classes, a model trained at another size or width; with ``run``: what the
    run trained with); the inference config is updated to match. With ``check`` the exported TorchScript is
    compared with the eager network on a random input and must agree.
    Returns ``out``.
    """
    from monai.bundle import ckpt_export

    bundle = bundle_path(bundle)
    out = Path(out).resolve()
    if out == bundle:
        raise ValueError(f"{out}: export into a new folder, not over the source bundle")
    trained = Run(run).config if run else None  # before any work: a --run that is no run is one line
    if trained is not None and site_state is None and _bn_policy(trained) == "fedbn":
        raise ValueError(f"{run}: a FedBN run's global model carries the initial batch norm, which no site "
                         "trained with; export a hospital's own model with its state file "
                         "(--site-state fedlabels_state/<run>/<site>)")
    state = load_state_dict(ckpt)
    site_name = None
    if site_state is not None:
        from ..methods.base import personal_model
        from ..site import latest_state, state_site

        site_name = state_site(site_state)
        state = personal_model(state, latest_state(site_state))
        provenance = {**(provenance or {}), "site_state": str(site_state)}

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))  # same filesystem: atomic swap
    try:
        for name in BUNDLE_FILES:
            src = bundle / name
            if src.is_dir():
                shutil.copytree(src, staging / name)
            elif src.is_file():
                shutil.copy2(src, staging / name)
        (staging / "models").mkdir()
        infer_path = staging / "configs" / "inference.json"
        meta_path = staging / "configs" / "metadata.json"
        infer = json.loads(infer_path.read_text())
        meta = json.loads(meta_path.read_text())
        if image_size is None and trained is not None:
            image_size = trained.bundle_config().get("image_size")
        preset_name = trained.bundle_config().get("preset") if trained is not None else None
        if preset_name:  # the run trained with a preset: inference scales and sizes its input the same way
            from ..presets import load as load_preset

            preset = json.loads(load_preset(preset_name, bundle).path.read_text())
            image_size = preset.get("image_size") if image_size is None else image_size
            if "intensity" in preset:
                if "intensity" not in infer:
                    raise ValueError(f"{bundle}/configs/inference.json: no 'intensity' entry to carry the "
                                     f"intensity scaling of the run's preset {preset_name!r}")
                infer["intensity"] = preset["intensity"]
            for key, value in preset.items():  # the network the preset trained (e.g. its width)
                if key.startswith("network_def#"):
                    name = key.split("#", 1)[1]
                    if name not in infer["network_def"]:
                        raise ValueError(f"{bundle}/configs/inference.json: network_def has no {name!r} to carry "
                                         f"the network setting {key}={value!r} of the run's preset {preset_name!r}")
                    infer["network_def"][name] = value
        if class_names is None and data is not None:  # the scenario's classes, not the bundle's defaults
            from ..profile import load_scenario

            class_names = load_scenario(data, sites=[], with_test=False, check_files=False).classes
        if class_names is not None:
            infer["class_names"] = [str(c) for c in class_names]
        window = _scenario_window(data) if data is not None else None
        if window is not None:  # the window the scenario's DICOM images were decoded with (data.dicom)
            if "dicom_window" not in infer:
                raise ValueError(f"{bundle}/configs/inference.json: no 'dicom_window' entry to carry the DICOM "
                                 f"window {window!r} of scenario {data}")
            infer["dicom_window"] = window
        if image_size is not None:
            infer["image_size"] = int(image_size)
        from ..nets import is_twin

        twin_model = is_twin(state)
        state = _twin_network(state, infer, twin, ckpt)
        for key, value in {**(trained.network if trained else {}), **(network or {})}.items():
            if key == "init_ckpt" or (twin_model and key in ("_target_", "output")):
                continue  # where training started; a FedMix model's network class (set above)
            if key == "out_channels" and key not in infer["network_def"]:  # outputs follow the class list
                if isinstance(infer["class_names"], list) and len(infer["class_names"]) == value:
                    continue
                raise ValueError(f"{ckpt}: the run's network has {value} outputs (network option out_channels) "
                                 f"but the inference class list is {infer['class_names']!r}: give the scenario "
                                 "(--data) or the class names")
            if key not in infer["network_def"]:
                raise ValueError(f"{bundle}/configs/inference.json: network_def has no {key!r} to carry the network "
                                 f"option {key}={value!r}")
            infer["network_def"][key] = value
        names = infer["class_names"]
        provenance = {**(Run(run).provenance(ckpt) if run else {}), **(provenance or {})}
        _update_metadata(meta, names, infer["image_size"], infer["in_channels"], metrics, provenance, bundle, ckpt)
        infer_path.write_text(json.dumps(infer, indent=4) + "\n")
        meta_path.write_text(json.dumps(meta, indent=4) + "\n")

        # the weights must fit the inference network exactly
        parser = _inference_parser(staging)
        net = parser.get_parsed_content("network_def")
        result = net.load_state_dict(state, strict=False)
        problems = []
        if result.missing_keys:
            problems.append(f"missing {len(result.missing_keys)} keys (e.g. {result.missing_keys[:4]})")
        if result.unexpected_keys:
            problems.append(f"unexpected {len(result.unexpected_keys)} keys (e.g. {result.unexpected_keys[:4]})")
        if problems:
            raise ValueError(f"{ckpt}: weights do not fit {bundle.name}'s network ({type(net).__name__}): "
                             + "; ".join(problems))
        pt = staging / "models" / "model.pt"
        torch.save(net.state_dict(), pt)
        if data is not None:
            from . import card

            # a hospital's own model (--site-state) is judged on that hospital's validation cases
            sites = [site_name] if site_state is not None else provenance.get("sites")
            _add_evidence(meta, card.evidence(net, bundle, data, names, sites=sites, summaries=_summaries(run),
                                               image_size=infer["image_size"]))
            meta_path.write_text(json.dumps(meta, indent=4) + "\n")
            readme = staging / "docs" / "README.md"
            readme.write_text(card.model_card(meta) + "\n---\n\n" + readme.read_text())

        ts = staging / "models" / "model.ts"
        ckpt_export(
            net_id="network_def",
            filepath=str(ts),
            ckpt_file=str(pt),
            meta_file=str(meta_path),
            config_file=str(infer_path),
            bundle_root=str(staging),
        )
        if check:
            check_torchscript(staging)
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    logger.info(f"exported {bundle.name} -> {out} (models/model.pt, models/model.ts; classes {names})")
    return out


def _twin_network(state: dict, infer: dict, twin: str, ckpt) -> dict:
    """The weights (and, for ``twin="mean"``, the inference network) a FedMix model ships with."""
    from ..nets import TwinUNet, first_of_twin, is_twin

    if twin not in TwinUNet.OUTPUTS:
        raise ValueError(f"twin must be one of {TwinUNet.OUTPUTS}, not {twin!r}")
    if not is_twin(state):
        if twin != "first":
            raise ValueError(f"{ckpt}: twin={twin!r} needs a FedMix model (two UNets f1, f2); this one has one network")
        return state
    if twin == "first":
        return first_of_twin(state)
    net = infer["network_def"]
    norm = net.get("norm")
    groups = norm[1].get("num_groups", 8) if isinstance(norm, list) and len(norm) == 2 and isinstance(norm[1], dict) else 8
    infer["network_def"] = {"_target_": "fedlabels.nets.TwinUNet", "output": "mean", "num_groups": groups,
                            **{k: net[k] for k in ("spatial_dims", "in_channels", "out_channels", "features") if k in net}}
    return state


def _update_metadata(meta, names, image_size, in_channels, metrics, provenance, bundle, ckpt) -> None:
    fmt = meta["network_data_format"]
    fmt["inputs"]["image"]["spatial_shape"] = [int(image_size), int(image_size)]
    fmt["inputs"]["image"]["num_channels"] = int(in_channels)
    pred = fmt["outputs"]["pred"]
    if pred.get("format") == "classes":
        pred["num_channels"] = len(names)
        pred["channel_def"] = {str(i): n for i, n in enumerate(names)}
    else:
        pred["spatial_shape"] = [int(image_size), int(image_size)]
    meta["class_names"] = list(names)
    if "class_codes" in meta:  # the standard codes of the classes this model predicts (bundle.dicom.ClassCodes)
        meta["class_codes"] = {c: code for c, code in meta["class_codes"].items() if c in names}
    if metrics:
        meta["eval_metrics"] = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    meta["provenance"] = {
        "source_bundle": bundle.name,
        "source_bundle_version": meta.get("version"),
        "checkpoint": str(ckpt) if isinstance(ckpt, (str, os.PathLike)) else "<in-memory state dict>",
        "exported": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **(provenance or {}),
    }


def _add_evidence(meta: dict, ev: dict) -> None:
    meta["decision_thresholds"] = ev["decision_thresholds"]
    meta["training"] = {k: ev[k] for k in ("task", "scenario", "scenario_dir", "label_table", "label_table_source",
                                           "threshold_rule", "validation_cases", "validation_sites")}
    meta["test_metrics"] = ev["test"]
    if ev["test"]:  # the schema's flat name -> score view
        for name, m in ev["test"]["per_class"].items():
            for key in ("auroc", "dice"):
                if m.get(key) is not None:
                    meta["eval_metrics"][f"test_{key}/{name}"] = m[key]
        if ev["test"].get("accuracy"):
            meta["eval_metrics"]["test_accuracy"] = ev["test"]["accuracy"]["value"]


def _summaries(run) -> dict | None:
    """The label summaries the run's server received (``label_summaries.json``), if recorded."""
    path = Path(run) / "label_summaries.json" if run else None
    return json.loads(path.read_text()) if path and path.is_file() else None


def _bn_policy(cfg) -> str:
    from .. import methods

    return methods.get(cfg.method).client_options(**cfg.client).get("bn_policy", "fedavg")


def check_torchscript(bundle, atol: float = 1e-4, rtol: float = 1e-4) -> float:
    """Largest |TorchScript - eager| of an exported bundle on a random input; raises above tolerance."""
    bundle = Path(bundle)
    parser = _inference_parser(bundle)
    net = parser.get_parsed_content("network_def")
    net.load_state_dict(torch.load(bundle / "models" / "model.pt", map_location="cpu", weights_only=True))
    net.eval()
    ts = torch.jit.load(str(bundle / "models" / "model.ts"), map_location="cpu")
    ts.eval()
    fmt = parser.get("_meta_#network_data_format#inputs#image")
    g = torch.Generator().manual_seed(0)
    x = torch.rand(2, int(fmt["num_channels"]), *[int(s) for s in fmt["spatial_shape"]], generator=g)
    with torch.no_grad():
        a, b = net(x), ts(x)
    diff = float((a - b).abs().max())
    if not torch.allclose(a, b, atol=atol, rtol=rtol):
        raise RuntimeError(f"{bundle}/models/model.ts disagrees with the eager network (max |diff| {diff:.3g})")
    return diff


__all__ = ["train_bundle", "evaluate_bundle", "export_bundle", "load_state_dict", "torch_load", "check_torchscript",
           "check_scenario"]

"""The run configuration (fedlabels.config.RunConfig): typed JSON, checked by name before round 0."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from fedlabels.config import ConfigError, RunConfig

JOBS = Path(__file__).resolve().parents[2] / "nvflare_jobs"


def write(tmp_path, doc, name="fedlabels.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def test_small_learning_rates_stay_floats(tmp_path):
    cfg = RunConfig("surgical", client={"lr": 5e-05, "warmup_lr": 0.005})
    path = cfg.save(tmp_path / "fedlabels.json")
    assert "5e-05" in path.read_text()  # JSON writes it in exponent form ...
    loaded = RunConfig.load(path)
    assert type(loaded.client["lr"]) is float and loaded.client["lr"] == 5e-05  # ... and reads back a float
    assert loaded.to_json() == cfg.to_json()
    # The old YAML configuration's bug: YAML 1.1 (PyYAML) wants a dot in a float, so 5e-05 was a string.
    assert yaml.safe_load("5e-05") == "5e-05"
    assert yaml.safe_load("lr: 5e-05") == {"lr": "5e-05"}


def test_unknown_field_names_the_file_and_the_field(tmp_path):
    path = write(tmp_path, {"method": "fedavg", "rounds": 3})
    with pytest.raises(ConfigError) as err:
        RunConfig.load(path)
    assert str(path) in str(err.value) and "'rounds'" in str(err.value)
    assert isinstance(err.value, ValueError)


def test_missing_method_and_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="'method'"):
        RunConfig.load(write(tmp_path, {"bundle": "cxr_resnet18"}))
    bad = tmp_path / "broken.json"
    bad.write_text("{method: fedavg")
    with pytest.raises(ConfigError, match="not valid JSON") as err:
        RunConfig.load(bad)
    assert str(bad) in str(err.value)
    with pytest.raises(ConfigError, match="JSON object"):
        RunConfig.load(write(tmp_path, ["fedavg"], "list.json"))
    with pytest.raises(FileNotFoundError, match="missing"):
        RunConfig.load(tmp_path / "nowhere.json")


@pytest.mark.parametrize("field, value", [
    ("seed", "0"), ("seed", True), ("seed", 0.5), ("min_sites", "1"), ("client", ["lr", 0.1]),
    ("server", None), ("faults", "site-1:crash:2"), ("method", 3), ("key_metric", 1),
    ("site_timeout", "60"), ("site_timeout", 1.5), ("site_timeout", True),
])
def test_bad_types_fail_with_the_field_named(tmp_path, field, value):
    path = write(tmp_path, {"method": "fedavg", field: value})
    with pytest.raises(ConfigError) as err:
        RunConfig.load(path)
    assert f"field {field!r}" in str(err.value) and str(path) in str(err.value)


def test_min_sites_below_one_fails_validation(tmp_path):
    path = write(tmp_path, {"method": "fedavg", "min_sites": 0})
    cfg = RunConfig.load(path)  # the type is right ...
    for side in ("server", "client"):
        with pytest.raises(ConfigError, match="'min_sites'") as err:  # ... the value is not
            cfg.validate(side)
        assert str(path) in str(err.value)


def test_site_timeout_is_seconds_and_left_out_when_unset(tmp_path):
    """A hung site is left out after site_timeout seconds (fedlabels.flare.controller); 0 or less would
    never wait, unset is the default (and keeps older configurations byte-identical)."""
    cfg = RunConfig.load(write(tmp_path, {"method": "fedavg", "site_timeout": 0}))
    with pytest.raises(ConfigError, match="'site_timeout'"):
        cfg.validate("server")
    assert "site_timeout" not in RunConfig(method="fedavg").to_json()
    assert RunConfig.from_json(RunConfig(method="fedavg", site_timeout=90).to_json()).site_timeout == 90


def test_server_options_are_checked_by_the_server_rule(tmp_path):
    # warmup_epochs is a Surgical *client* option: the server rule does not know it.
    path = write(tmp_path, {"method": "surgical", "client": {"warmup_epochs": 3}, "server": {"warmup_epochs": 3}})
    cfg = RunConfig.load(path)
    with pytest.raises(ConfigError, match="warmup_epochs") as err:
        cfg.validate("server")
    assert "field 'server'" in str(err.value) and str(path) in str(err.value)
    cfg.server = {"weighted": True, "head_name": "head"}
    cfg.validate("server")
    cfg.validate("client")


def test_client_options_are_checked_by_the_client_rule(tmp_path):
    path = write(tmp_path, {"method": "surgical", "client": {"lr": 0.001, "weighted": False}})
    cfg = RunConfig.load(path)
    with pytest.raises(ConfigError, match="weighted") as err:
        cfg.validate("client")
    assert "field 'client'" in str(err.value)
    cfg.validate("server")  # the server side does not read client options
    cfg.client = {"lr": 0.001, "warmup_epochs": 3, "bn_policy": "fedbn", "pos_weighted": False}
    cfg.validate("client")
    # Removed options fail by name, on the side that had them.
    for doc, side, name in [({"method": "fedpsl", "server": {"weighted": True}}, "server", "weighted"),
                            ({"method": "surgical", "client": {"feature_rule": "fedbn"}}, "client", "feature_rule"),
                            ({"method": "fedpsl", "client": {"pos_weight": [1.0]}}, "client", "pos_weight")]:
        with pytest.raises(ConfigError, match=name):
            RunConfig.from_json(doc, "job.json").validate(side)


def test_unknown_method_fails_validation():
    cfg = RunConfig.from_json({"method": "fedsomething"}, "job.json")
    with pytest.raises(ConfigError, match="field 'method'.*fedsomething"):
        cfg.validate("server")


def test_key_metric_defaults_to_the_task():
    cfg = RunConfig("fedavg")
    assert cfg.metric("multilabel") == "val_auroc" and cfg.metric("multiclass") == "val_accuracy"
    assert RunConfig("fedavg", key_metric="val_ap").metric("multilabel") == "val_ap"


@pytest.mark.parametrize("path", sorted(JOBS.glob("*/app/custom/fedlabels.json")), ids=lambda p: p.parts[-4])
def test_the_shipped_jobs_validate(path):
    cfg = RunConfig.load(path)
    cfg.validate("server")
    cfg.validate("client")


@pytest.mark.parametrize("size", [4, "32", True, 32.0])
def test_image_size_must_be_a_pixel_count(size):
    with pytest.raises(ConfigError, match=r"job/fedlabels.json: field 'data.image_size': expected an integer >= 8"):
        RunConfig.from_json({"method": "fedavg", "data": {"image_size": size}}, "job/fedlabels.json")
    cfg = RunConfig("fedavg")
    cfg.data.image_size = size  # set in code after parsing: validate checks it again
    with pytest.raises(ConfigError, match=r"field 'data.image_size': expected an integer >= 8"):
        cfg.validate("client")


def test_image_size_is_the_bundle_config_the_sites_train_with():
    assert RunConfig("fedavg", data={"image_size": 32}).bundle_config() == {"image_size": 32}
    assert RunConfig("fedavg").bundle_config() == {}

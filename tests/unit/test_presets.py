"""Protocol presets (fedlabels.presets): override files merged the MONAI way, read by bench, jobs and export."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fedlabels import bench, cli, presets
from fedlabels.bundle import read
from fedlabels.config import ConfigError, RunConfig

# what a preset sets that is not a bundle key
META = {"_comment", "federated", "sources"}


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_every_value_a_preset_sets_names_its_source(name):
    p = presets.load(name)
    raw = json.loads(p.path.read_text())
    keys = set(raw) - META
    keys |= {f"federated.{k}" for k in ("rounds", "local_epochs")}
    keys |= {f"federated.client.{k}" for k in raw["federated"]["client"] if k != "weight_decay" or raw["federated"]["client"][k]}
    missing = sorted(k for k in keys if k not in p.sources and k not in ("lr",))  # lr: the bundle's copy of client.lr
    assert missing == [], f"{p.path}: no source for {missing}"
    assert raw.get("lr", p.client["lr"]) == p.client["lr"]  # the bundle's own lr agrees with the client's
    # the merged config parses and builds its transforms and network
    parser = read(p.bundle, "", preset=name, class_names=["a", "b"])
    parser.get_parsed_content("train#preprocessing", instantiate=True)
    parser.get_parsed_content("network_def", instantiate=True)


def test_read_merges_the_preset_over_train_json():
    default = read("cxr_densenet121", "", class_names=["a"])
    fedpsl = read("cxr_densenet121", "", preset="fedpsl", class_names=["a"])
    assert default["intensity"]["_target_"] == "ScaleIntensityd"
    assert fedpsl["intensity"]["_target_"] == "NormalizeIntensityd" and fedpsl["image_size"] == 224
    tf = fedpsl.get_parsed_content("train#preprocessing", instantiate=True)
    assert type(tf.transforms[3]).__name__ == "NormalizeIntensityd"
    # the keys a preset does not set stay the bundle's
    assert fedpsl["train"]["strong_random_transforms"] == default["train"]["strong_random_transforms"]


def test_isofed_preset_scales_the_fixed_0_255_range_to_minus_one_one():
    tf = read("medmnist_cnn", "", preset="isofed", class_names=["a"]).get_parsed_content("intensity")
    out = tf({"image": torch.tensor([[[0.0, 127.5, 255.0]]])})["image"]
    assert torch.allclose(torch.as_tensor(out), torch.tensor([[[-1.0, 0.0, 1.0]]]))
    # not per image: an image spanning 100-150 keeps its place in the range
    out = tf({"image": torch.tensor([[[100.0, 150.0]]])})["image"]
    assert torch.allclose(torch.as_tensor(out), torch.tensor([[[100 / 127.5 - 1, 150 / 127.5 - 1]]]))


def test_bench_preset_sets_defaults_that_explicit_options_override():
    parser = cli.build_parser(flare=False)
    base = ["bench", "--data", "d", "--methods", "fedavg,isofed", "--preset", "isofed", "--out", "unused"]
    plan = bench.make_plan(parser.parse_args(base))
    assert plan.bundle.name == "medmnist_cnn" and plan.rounds == 100 and plan.local_epochs == 1
    assert plan.options["fedavg"]["client"] == {"optimizer": "adam", "lr": 0.001, "weight_decay": 0.0,
                                                "reset_optimizer": True, "epochs": 1}
    assert plan.floor_client == {"optimizer": "adam", "lr": 0.001, "weight_decay": 0.0, "reset_optimizer": True}
    assert plan.config == {"preset": "isofed"}
    plan = bench.make_plan(parser.parse_args(base + ["--rounds", "7", "--local-epochs", "2", "--opt", "all:lr=0.01",
                                                     "--image-size", "32"]))
    assert plan.rounds == 7 and plan.options["isofed"]["client"]["epochs"] == 2
    assert plan.options["isofed"]["client"]["lr"] == 0.01 and plan.floor_client["lr"] == 0.01
    assert plan.config == {"preset": "isofed", "image_size": 32}
    plan.datasets[0] = "d"
    cell = bench.cell_config(plan, bench.Cell("fedavg", 0))  # a finished cell of another preset is not reused
    assert cell["preset"] == "isofed"


def test_bench_preset_errors_name_the_problem(tmp_path):
    parser = cli.build_parser(flare=False)
    with pytest.raises(ValueError, match="unknown preset"):
        bench.make_plan(parser.parse_args(["bench", "--data", "d", "--methods", "fedavg", "--preset", "nope",
                                           "--out", "u"]))
    with pytest.raises(ValueError, match="has no configs/presets/isofed.json"):
        bench.make_plan(parser.parse_args(["bench", "--data", "d", "--methods", "fedavg", "--preset", "isofed",
                                           "--bundle", "lesion_unet", "--out", "u"]))
    with pytest.raises(ValueError, match="--bundle and --rounds are required"):
        bench.make_plan(parser.parse_args(["bench", "--data", "d", "--methods", "fedavg", "--out", "u"]))
    # a malformed preset file: one error naming the file and the field
    bundle = tmp_path / "b"
    (bundle / "configs" / "presets").mkdir(parents=True)
    (bundle / "configs" / "metadata.json").write_text("{}")
    bad = bundle / "configs" / "presets" / "x.json"
    bad.write_text(json.dumps({"federated": {"rounds": 0, "local_epochs": 1}}))
    with pytest.raises(ValueError, match=r"x.json: field 'federated.rounds'"):
        presets.load("x", bundle)
    bad.write_text(json.dumps({"federated": {"rounds": 1, "local_epochs": 1, "client": {"nesterov": True}}}))
    with pytest.raises(ValueError, match=r"x.json: field 'federated.client': unknown key"):
        presets.load("x", bundle)


def test_run_config_carries_the_preset_to_every_site():
    cfg = RunConfig(method="fedavg", bundle="medmnist_cnn", data={"preset": "isofed", "image_size": 28})
    cfg.validate("client")
    assert cfg.bundle_config() == {"preset": "isofed", "image_size": 28}
    assert RunConfig.from_json(cfg.to_json()) == cfg and cfg.to_json()["data"]["preset"] == "isofed"
    with pytest.raises(ConfigError, match="'data.preset'"):
        RunConfig(method="fedavg", bundle="medmnist_cnn", data={"preset": 3})
    # a name the run's data section does not have (the preset's old name among them) is refused, named
    for doc, field in (({"protocol": "isofed"}, "data.protocol"), ({"image_size": 4}, "data.image_size"),
                       ({"batch_size": "all"}, "data.batch_size"), ({"oracle": "yes"}, "data.oracle")):
        with pytest.raises(ConfigError, match=f"'{field}'"):
            RunConfig.from_json({"method": "fedavg", "data": doc}, "fedlabels.json")


def test_rand_mirror_is_monai_rand_flip_without_metadata():
    from monai.transforms import RandFlipd

    from fedlabels.bundle.data import RandMirrord

    x = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    for axis in (0, 1):
        ours = RandMirrord(["image"], prob=1.0, spatial_axis=axis)({"image": x})["image"]
        theirs = RandFlipd(["image"], prob=1.0, spatial_axis=axis)({"image": x})["image"]
        assert torch.equal(ours, torch.as_tensor(theirs))
        ours = RandMirrord(["image"], prob=1.0, spatial_axis=axis)({"image": x.numpy()})["image"]
        assert np.array_equal(ours, np.asarray(theirs))
    assert torch.equal(RandMirrord(["image"], prob=0.0)({"image": x})["image"], x)


def test_isofed_rscfed_preset_reaches_each_row_with_the_options_its_rules_take():
    parser = cli.build_parser(flare=False)
    base = ["bench", "--data", "d", "--methods", "isofed,rscfed,fedavg,oracle:wfedavg", "--preset", "isofed_rscfed",
            "--out", "unused"]
    plan = bench.make_plan(parser.parse_args(base))
    assert plan.rounds == 1000 and plan.local_epochs == 1
    generic = {"optimizer": "sgd", "lr": 0.03, "momentum": 0.9, "weight_decay": 0.0005, "clip_grad_norm": 5.0,
               "reset_optimizer": False}
    iso = plan.options["isofed"]
    assert iso["client"] == {**generic, "epochs": 1, "lr_unlabeled": 0.021, "consistency_weight": 0.02,
                             "consistency_rampup": 0, "temperature": 0.5, "ema_alpha": 0.001}
    # IsoFed's server has no subsets; RSCFed's has
    assert iso["server"] == {"warmup_rounds": 7, "lambda_c": 100.0, "lambda_unlabeled": 10000.0,
                             "labeled_multiplier": 6.0}
    assert plan.options["rscfed"]["server"]["subsets"] == 3 and plan.options["rscfed"]["server"]["subset_size"] == 3
    # supervised rows and the floor take the generic client settings only
    assert plan.options["fedavg"] == {"client": {**generic, "epochs": 1}, "server": {}}
    assert plan.options["oracle:wfedavg"]["server"]["warmup_rounds"] == 7  # all sites labeled: the plan is unchanged
    assert plan.floor_client == generic
    # the rules accept every option (a name no rule takes would fail here)
    from fedlabels import methods

    for row in ("isofed", "rscfed", "fedavg", "oracle:wfedavg"):
        m = methods.get(bench.base_method(row))
        m.client_options(**plan.options[row]["client"])
        m.make_server(**plan.options[row]["server"])
    # --opt still overrides a preset option
    plan = bench.make_plan(parser.parse_args(base + ["--opt", "isofed:warmup_rounds=0", "--opt", "isofed:lr_unlabeled=0.01"]))
    assert plan.options["isofed"]["server"]["warmup_rounds"] == 0 and plan.options["isofed"]["client"]["lr_unlabeled"] == 0.01


def test_a_job_with_a_preset_trains_with_what_bench_gives_its_rows():
    """A FLARE job naming a preset gets the same client settings and method options as a bench row of that
    preset; the job's own options override them."""
    from fedlabels.flare.job import JOBS, job

    parser = cli.build_parser(flare=False)
    plan = bench.make_plan(parser.parse_args(["bench", "--data", "d", "--methods", "isofed,rscfed", "--preset",
                                              "isofed_rscfed", "--out", "unused"]))
    for row in ("isofed", "rscfed"):
        cfg = job(f"{row}_medmnist", row, bundle="medmnist_cnn", family="medmnist", preset="isofed_rscfed").run
        assert (cfg.client, cfg.server) == (plan.options[row]["client"], plan.options[row]["server"])
        assert cfg.client["momentum"] == 0.9 and cfg.client["lr_unlabeled"] == 0.021
        assert cfg.data.preset == "isofed_rscfed" and cfg.bundle_config() == {"preset": "isofed_rscfed"}
    cfg = job("mine", "isofed", bundle="medmnist_cnn", family="medmnist", preset="isofed_rscfed", client={"lr": 0.01},
              server={"warmup_rounds": 0}).run
    assert cfg.client["lr"] == 0.01 and cfg.client["momentum"] == 0.9 and cfg.server["warmup_rounds"] == 0
    # the shipped jobs name the isofed preset and set nothing of their own: its client settings are theirs
    assert JOBS["isofed_medmnist"].run.client == {"optimizer": "adam", "lr": 0.001, "weight_decay": 0.0,
                                                  "reset_optimizer": True, "epochs": 1}


def test_preset_options_are_checked_against_the_registered_rules(tmp_path):
    bundle = tmp_path / "b"
    (bundle / "configs" / "presets").mkdir(parents=True)
    (bundle / "configs" / "metadata.json").write_text("{}")
    bad = bundle / "configs" / "presets" / "x.json"
    bad.write_text(json.dumps({"federated": {"rounds": 1, "local_epochs": 1, "options": {"lr_unlabled": 0.1}}}))
    with pytest.raises(ValueError, match=r"x.json: field 'federated.options': \['lr_unlabled'\]"):
        presets.load("x", bundle)
    bad.write_text(json.dumps({"federated": {"rounds": 1, "local_epochs": 1, "options": {"lr": 0.1}}}))
    with pytest.raises(ValueError, match=r"x.json: field 'federated.options': \['lr'\] belong in 'federated.client'"):
        presets.load("x", bundle)


def test_isofed_rscfed_augmentation_is_a_crop_of_the_image_enlarged_by_a_quarter_and_a_flip():
    """RSCFed's released transform (resize to 40, RandomCrop 32, horizontal flip) at MedMNIST's 28 px:
    every training view is a 28 px window of the image resized to 35 px, mirrored or not."""
    from monai.transforms import Compose, Resized

    parser = read("medmnist_cnn", "", preset="isofed_rscfed", class_names=["a", "b"])
    tf = Compose(parser.get_parsed_content("train#random_transforms", instantiate=True))
    x = torch.rand(3, 28, 28, generator=torch.Generator().manual_seed(0))
    big = torch.as_tensor(Resized(["image"], (35, 35), mode="bilinear", anti_aliasing=False)({"image": x})["image"])
    windows = {}
    for i in range(8):
        for j in range(8):
            w = big[:, i:i + 28, j:j + 28]
            windows[(i, j, False)], windows[(i, j, True)] = w, torch.flip(w, dims=[1])  # axis 0: the width
    seen = set()
    for seed in range(40):
        tf.set_random_state(seed)
        out = torch.as_tensor(tf({"image": x.clone()})["image"])
        match = [k for k, w in windows.items() if torch.allclose(out, w, atol=1e-5)]
        assert match, f"seed {seed}: not a flipped or unflipped 28 px window of the 35 px image"
        seen.add(match[0])
    assert len({k[:2] for k in seen}) > 10 and {k[2] for k in seen} == {False, True}

"""Many sites on one machine: half-precision transfer, worker-process sizing, what a site imports."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from nvflare.apis.fl_context import FLContext
from nvflare.apis.utils.decomposers import flare_decomposers
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.decomposers import common_decomposers
from nvflare.app_common.utils.fl_model_utils import FLModelUtils
from nvflare.app_opt.pt.quantization.dequantizer import ModelDequantizer
from nvflare.app_opt.pt.quantization.quantizer import ModelQuantizer
from nvflare.fuel.utils import fobs

from fedlabels.bundle import bundle_path, network
from fedlabels.config import ConfigError, RunConfig
from fedlabels.data.synthetic import CXR_SITE_CLASSES, generate
from fedlabels.flare.simulator import SERVER_MIB, SITE_PROCESS_MIB, default_threads
from fedlabels.flare.controller import on_the_wire
from fedlabels.flare.job import JOBS, export
from fedlabels.methods.aggregate import average_keys
from fedlabels.methods.base import Update, load_weights, to_numpy
from fedlabels.profile import load_scenario

flare_decomposers.register()
common_decomposers.register()


def serialized(params: dict, quantize: bool):
    """What crosses the wire for an update: FLModel -> Shareable -> (filter) -> fobs bytes."""
    shareable = FLModelUtils.to_shareable(FLModel(params=params, params_type=ParamsType.FULL, meta={"n": 10}))
    if quantize:
        shareable = ModelQuantizer(quantization_type="float16").process(shareable, FLContext())
    return len(fobs.dumps(shareable)), shareable


@pytest.mark.parametrize("bundle", ["cxr_densenet121", "cxr_resnet18", "medmnist_cnn", "lesion_unet"])
def test_half_precision_halves_the_bytes_and_round_trips_within_float16(bundle):
    torch.manual_seed(0)
    state = to_numpy(network(bundle_path(bundle)).state_dict())
    full, _ = serialized(dict(state), quantize=False)
    half, shareable = serialized(on_the_wire(state, "float16"), quantize=True)
    # the arrays are exactly half; the filter's per-key metadata (source dtypes) and the
    # keys themselves add 0.2-1.1 % of the float32 message (the smallest network the most)
    sent = FLModelUtils.from_shareable(shareable).params
    assert sum(v.nbytes for v in sent.values()) * 2 == sum(v.nbytes for v in state.values() if v.dtype.kind == "f")
    assert half <= 0.52 * full, (half, full)
    back = FLModelUtils.from_shareable(ModelDequantizer().process(shareable, FLContext())).params
    floats = {k for k, v in state.items() if v.dtype.kind == "f"}
    assert set(back) == floats  # integer buffers stay where they are
    for k in floats:
        assert back[k].dtype == np.float32
        expected = state[k].astype(np.float16).astype(np.float32)  # float16 rounding, nothing worse
        np.testing.assert_array_equal(back[k], expected, err_msg=k)
        np.testing.assert_allclose(back[k], state[k], rtol=2 ** -11, atol=6e-8, err_msg=k)


def test_integer_buffers_stay_put_when_the_weights_travel_in_half_precision():
    glob = {"w": np.array([1.0, 2.0], np.float32), "bn.num_batches_tracked": np.array(7)}
    site = {"w": np.array([3.0, 4.0], np.float32), "bn.num_batches_tracked": np.array(12)}
    sent = on_the_wire(site, "float16")
    assert set(sent) == {"w"} and sent is not site and set(site) == {"w", "bn.num_batches_tracked"}
    assert on_the_wire(site, "float32") is site
    # the server keeps its global value of a key no update sent
    out = average_keys([Update("site-1", sent, 5)], glob, [1.0])
    np.testing.assert_array_equal(out["w"], [3.0, 4.0])
    assert int(out["bn.num_batches_tracked"]) == 7
    # and a site keeps its own
    net = torch.nn.BatchNorm1d(2)
    net.num_batches_tracked.fill_(12)
    load_weights(net, on_the_wire(to_numpy(net.state_dict()), "float16"))
    assert int(net.num_batches_tracked) == 12


def test_transfer_option_adds_nvflare_filters_both_ways(tmp_path):
    half = export(JOBS["fedavg_cxr"].replace(transfer="float16"), tmp_path / "half")
    full = export(JOBS["fedavg_cxr"], tmp_path / "full")
    paths = "nvflare.app_opt.pt.quantization.{}"
    record = "fedlabels.flare.sent.SentRecord"  # every job's last result filter: the site's audit record
    expect = {"server": {"task_data_filters": [paths.format("quantizer.ModelQuantizer")],
                         "task_result_filters": [paths.format("dequantizer.ModelDequantizer")]},
              "client": {"task_data_filters": [paths.format("dequantizer.ModelDequantizer")],
                         "task_result_filters": [paths.format("quantizer.ModelQuantizer"), record]}}
    for side, filters in expect.items():
        cfg = json.loads((half / "app" / "config" / f"config_fed_{side}.json").read_text())
        for key, want in filters.items():
            assert [f["path"] for chain in cfg[key] for f in chain["filters"]] == want
            assert all({"train", "validate"} <= set(chain["tasks"]) for chain in cfg[key])  # matched by task name
        plain = json.loads((full / "app" / "config" / f"config_fed_{side}.json").read_text())
        left = [f["path"] for key in ("task_data_filters", "task_result_filters") for chain in plain.get(key, [])
                for f in chain["filters"]]
        assert left == ([record] if side == "client" else [])
    assert json.loads((half / "app" / "custom" / "fedlabels.json").read_text())["transfer"] == "float16"


def test_transfer_must_be_a_known_precision():
    cfg = RunConfig.from_json({"method": "fedavg", "transfer": "int8"}, "job/fedlabels.json")
    with pytest.raises(ConfigError, match=r"job/fedlabels.json: field 'transfer': must be one of"):
        cfg.validate("server")


def test_default_worker_processes_fit_the_memory():
    # every site its own process while they fit: 16 * 1100 + 1500 <= 24000
    assert 16 * SITE_PROCESS_MIB + SERVER_MIB <= 24000 < 32 * SITE_PROCESS_MIB + SERVER_MIB
    assert default_threads(16, memory_mib=24000, cores=2) == 16
    # beyond that, one process per core and the sites take turns
    assert default_threads(32, memory_mib=24000, cores=2) == 2
    assert default_threads(32, memory_mib=24000, cores=64) == (24000 - SERVER_MIB) // SITE_PROCESS_MIB
    assert default_threads(32, memory_mib=1000, cores=8) == 1
    assert default_threads(3, memory_mib=1000, cores=8) == 1


def test_synth_with_more_sites_cycles_fedpsl_table_one(tmp_path):
    root = generate("cxr", tmp_path / "cxr", seed=0, cases=4, test_cases=4, size=16, sites=9)
    sc = load_scenario(root)
    assert list(sc.sites) == [f"site-{k}" for k in range(1, 10)]
    for k, site in enumerate(sc.sites.values()):
        assert tuple(site.profile.annotated) == tuple(CXR_SITE_CLASSES[k % 4])
    lesion = load_scenario(generate("lesion", tmp_path / "lesion", seed=0, cases=3, test_cases=2, size=16, sites=6))
    assert [s.profile.supervision for s in lesion.sites.values()] == ["pixel", "bbox", "image", "none", "pixel", "bbox"]


def test_a_site_process_imports_only_what_a_site_needs():
    """The client entry point in a fresh interpreter: none of fedlabels' benchmark,
    reporting, preparing or job-building code, and no quantization library unless a
    job asks for half precision. (matplotlib, scipy and scikit-image come with
    `import monai`, which loads all its submodules.)"""
    code = ("import sys, resource, fedlabels.flare.client; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith(('fedlabels', 'bitsandbytes'))))); "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    modules = set(out.stdout.split("\n")[0].split())
    assert "fedlabels.flare.client" in modules and "fedlabels.site" in modules
    unneeded = {"fedlabels.bench", "fedlabels.references", "fedlabels.cli", "fedlabels.flare.commands",
                "fedlabels.flare.job", "fedlabels.data.prepare", "fedlabels.data.synthetic", "fedlabels.bundle.workflows",
                "bitsandbytes"}
    assert not modules & unneeded, modules & unneeded
    assert not any(m.startswith("fedlabels.data.") for m in modules), sorted(modules)

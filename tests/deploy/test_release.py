"""The release: what ``python -m build`` makes from the checkout, installed where no checkout is.

The sdist and the wheel are built (offline: ``--no-isolation``, with this environment's setuptools),
their contents checked (the MONAI bundles and their presets are package data, the version is
``fedlabels.__version__``), and the wheel installed into a new virtual environment outside the
checkout. To keep it fast that environment sees this one's installed dependencies through a ``.pth``
file naming its site-packages (lines of a ``.pth`` file only add folders: this environment's own
``.pth`` files, the editable install's path to ``custom/`` among them, are not read), and the wheel
goes in with ``pip install --no-deps --no-index``. From a folder outside both, a researcher's and a
clinical engineer's path then runs on the installed package: ``fedlabels synth`` -> ``fedlabels bench``
(one round, tiny) -> ``python -m monai.bundle run`` training of the shipped bundle (the model to export)
-> ``fedlabels export`` -> ``python -m monai.bundle run`` inference of the exported bundle, DICOM
studies through ``fedlabels import``, training, export and the bundle's inference (the same array,
``tests/unit/test_dicom_pixels.py``), and ``fedlabels jobs``. Each step's outputs must exist, and no file
of the new environment may change
(``__pycache__`` aside). That test carries the ``release`` marker (``make test``, not ``make test-fast``);
the bundle lookup (``FEDLABELS_BUNDLES`` before the shipped bundles) and the wheel check that
provisioning uses are checked here in the fast lane.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

import fedlabels
from fedlabels import bundle, release

REPO = Path(__file__).resolve().parents[2]
VERSION = fedlabels.__version__


def _run(cmd, cwd, env=None, timeout=600) -> str:
    start = time.monotonic()
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} (in {cwd}) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    print(f"{time.monotonic() - start:6.1f} s  {' '.join(Path(str(c)).name if i == 0 else str(c) for i, c in enumerate(cmd))}")
    return proc.stdout


def _files(root: Path) -> dict:
    """Every file under ``root`` but compiled bytecode: path -> (size, modification time)."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


def _shipped_bundle_files() -> set:
    bundles = REPO / "bundles"
    return {f"bundles/{p.relative_to(bundles).as_posix()}" for p in bundles.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and not p.name.endswith((".pyc", ".pyo"))}


def _fresh_env(root: Path) -> tuple:
    """A new virtual environment that sees this one's installed dependencies; (python, its site-packages)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=root).strip())
    deps = dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")])
    (site / "fedlabels_test_dependencies.pth").write_text("".join(f"{d}\n" for d in deps))
    return python, site


def test_fedlabels_bundles_adds_and_overrides_bundles_by_name(tmp_path, monkeypatch):
    monkeypatch.delenv(bundle.ENV, raising=False)
    # an editable install (this checkout): the shipped bundles are the checkout's
    assert bundle.bundles_dir() == REPO / "bundles"
    assert bundle.bundle_path("cxr_resnet18") == REPO / "bundles" / "cxr_resnet18"
    shipped = bundle.available()
    assert set(shipped) >= {"cxr_densenet121", "cxr_resnet18", "medmnist_cnn", "lesion_unet"}
    mine, more = tmp_path / "mine", tmp_path / "more"
    shutil.copytree(REPO / "bundles" / "cxr_resnet18", mine / "cxr_resnet18")  # an edited copy of a shipped one
    shutil.copytree(REPO / "bundles" / "medmnist_cnn", more / "my_cnn")  # a bundle of one's own
    shutil.copytree(REPO / "bundles" / "lesion_unet", more / "cxr_resnet18")  # behind mine/ in the list: unused
    (more / "notes").mkdir()  # not a bundle: no configs/metadata.json
    monkeypatch.setenv(bundle.ENV, os.pathsep.join([str(mine), str(tmp_path / "missing"), str(more)]))
    assert bundle.bundle_path("cxr_resnet18") == mine / "cxr_resnet18"
    assert bundle.bundle_path("my_cnn") == more / "my_cnn"
    assert bundle.bundle_path("lesion_unet") == REPO / "bundles" / "lesion_unet"
    assert bundle.available() == {**shipped, "cxr_resnet18": mine / "cxr_resnet18", "my_cnn": more / "my_cnn"}
    assert bundle.read("cxr_resnet18")["bundle_root"] == str(mine / "cxr_resnet18")
    with pytest.raises(FileNotFoundError, match=r"nope: not a bundle folder .*bundles: \['cxr_densenet121'"):
        bundle.bundle_path("nope")


def _wheel(path: Path, name="fedlabels", version=VERSION) -> Path:
    """A wheel archive holding only its METADATA (what ``check_wheel`` reads)."""
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{path.name.split('-')[0]}-{path.name.split('-')[1]}.dist-info/METADATA",
                   f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return path


def test_check_wheel_accepts_only_the_wheel_of_the_running_version(tmp_path):
    good = _wheel(tmp_path / release.wheel_name())
    assert release.check_wheel(good) == release.sha256(good)
    other = _wheel(tmp_path / release.wheel_name("0.0.1"), version="0.0.1")
    with pytest.raises(ValueError, match=f"fedlabels 0.0.1, but this environment runs fedlabels {VERSION}"):
        release.check_wheel(other)
    assert release.check_wheel(other, version="0.0.1") == release.sha256(other)
    (tmp_path / "renamed").mkdir()
    lying = _wheel(tmp_path / "renamed" / release.wheel_name(), version="0.0.1")
    with pytest.raises(ValueError, match="its METADATA says fedlabels 0.0.1, its name fedlabels"):
        release.check_wheel(lying)
    with pytest.raises(ValueError, match="not a fedlabels wheel"):
        release.check_wheel(_wheel(tmp_path / f"monai-{VERSION}-py3-none-any.whl"))
    with pytest.raises(ValueError, match="no such file"):
        release.check_wheel(tmp_path / "dist" / release.wheel_name())
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / release.wheel_name()).write_text("not a zip")
    with pytest.raises(ValueError, match="not a readable wheel"):
        release.check_wheel(tmp_path / "broken" / release.wheel_name())
    assert release.installed_sha256() is None  # this checkout's editable install: no wheel behind it


def test_provision_refuses_a_wheel_of_another_version_before_writing_a_kit(tmp_path):
    from fedlabels import cli

    other = _wheel(tmp_path / release.wheel_name("0.0.1"), version="0.0.1")
    with pytest.raises(ValueError, match=r"--wheel .*fedlabels 0.0.1, but this environment runs fedlabels"):
        from fedlabels.flare.provision import provision

        provision(tmp_path / "prov", "p", "localhost", ["hospital-a"], "admin@example.org", wheel=other)
    assert not (tmp_path / "prov").exists()
    assert cli.main(["provision", "--project", "p", "--server", "localhost", "--sites", "hospital-a", "--admin",
                     "admin@example.org", "--wheel", str(other), "--out", str(tmp_path / "prov")]) != 0


@pytest.mark.release
def test_the_wheel_installs_and_runs_outside_the_checkout(tmp_path):
    assert REPO not in tmp_path.parents, "the test's folders must lie outside the checkout"
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, REPO], cwd=tmp_path)

    # both archives hold the bundles (with their presets) and carry the one version
    wheel, sdist = dist / f"fedlabels-{VERSION}-py3-none-any.whl", dist / f"fedlabels-{VERSION}.tar.gz"
    assert sorted(p.name for p in dist.iterdir()) == sorted([sdist.name, wheel.name])
    shipped = _shipped_bundle_files()
    assert {"bundles/cxr_resnet18/configs/presets/cxr.json", "bundles/medmnist_cnn/configs/presets/isofed.json",
            "bundles/cxr_densenet121/LICENSE", "bundles/README.md"} <= shipped
    with zipfile.ZipFile(wheel) as z:
        in_wheel = set(z.namelist())
    assert {f"fedlabels/{f}" for f in shipped} <= in_wheel
    assert {"fedlabels/cli.py", "fedlabels/flare/client_script.py", f"fedlabels-{VERSION}.dist-info/entry_points.txt"} \
        <= in_wheel
    assert not [n for n in in_wheel if "__pycache__" in n or n.startswith(("tests/", "bundles/", "custom/"))]
    with tarfile.open(sdist) as t:
        in_sdist = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert shipped | {"setup.py", "setup.cfg", "pyproject.toml", "MANIFEST.in", "CHANGELOG.md", "constraints.txt",
                      "custom/fedlabels/__init__.py"} <= in_sdist
    assert f"## {VERSION}" in (REPO / "CHANGELOG.md").read_text()

    # the provisioning machine hands the wheel to every kit; the hospital installs the kit's copy (deployment.md)
    out = _run([sys.executable, "-m", "fedlabels.cli", "provision", "--project", "rel", "--server", "localhost",
                "--sites", "hospital-a", "--admin", "admin@example.org", "--wheel", wheel, "--out", tmp_path / "prov"],
               cwd=tmp_path)
    kit = tmp_path / "prov" / "rel" / "prod_00" / "hospital-a"
    digest = release.check_wheel(wheel)
    assert (kit / "startup" / "fedlabels.sha256").read_text() == f"{digest}  {wheel.name}\n"
    assert (kit / "startup" / "requirements.txt").read_text().splitlines()[:2] == ["--find-links .",
                                                                                  f"fedlabels=={VERSION}"]
    env_dir = tmp_path / "env"
    python, site = _fresh_env(env_dir)
    _run([python, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "-q",
          kit / "startup" / wheel.name], cwd=tmp_path)
    # the rest of the kit's pins: here already in the environment (its .pth), so no index is asked
    _run([python, "-m", "pip", "install", "--no-index", "-q", "-r", kit / "startup" / "requirements.txt"],
         cwd=tmp_path)
    if shutil.which("sha256sum"):
        _run(["sha256sum", "-c", "fedlabels.sha256"], cwd=kit / "startup")
    before = _files(env_dir)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "FEDLABELS_BUNDLES", "FEDLABELS_DATA")}
    env.update(PATH=os.pathsep.join([str(env_dir / "bin"), env.get("PATH", "")]), OMP_NUM_THREADS="1",
               PYTHONDONTWRITEBYTECODE="1", FEDLABELS_CACHE=str(tmp_path / "cache"),
               FEDLABELS_PRIVACY_LEDGER=str(tmp_path / "ledger.json"))
    fedlabels_cmd = env_dir / "bin" / "fedlabels"
    work = tmp_path / "work"
    work.mkdir()

    # the installed package, not the checkout, with its own bundles
    where = _run([python, "-c", "import fedlabels, fedlabels.bundle as b, fedlabels.release as r; "
                                "print(fedlabels.__file__, fedlabels.__version__, b.bundles_dir(), r.installed_sha256())"],
                 cwd=work, env=env).split()
    assert Path(where[0]).parent == site / "fedlabels" and where[1] == VERSION
    assert Path(where[2]) == (site / "fedlabels" / "bundles").resolve()
    assert where[3] == digest  # the file it came from, as a site reports it
    assert _run([fedlabels_cmd, "--version"], cwd=work, env=env).strip() == f"fedlabels {VERSION}"
    listed = _run([fedlabels_cmd, "bundles"], cwd=work, env=env)
    assert str(site / "fedlabels" / "bundles" / "cxr_resnet18") in listed and str(REPO) not in listed

    _run([fedlabels_cmd, "synth", "cxr", "--out", "data/cxr", "--cases", "60", "--size", "32", "--test-cases", "24"],
         cwd=work, env=env)
    assert (work / "data" / "cxr" / "scenario.yaml").is_file()
    _run([fedlabels_cmd, "bench", "--data", "data/cxr", "--bundle", "cxr_resnet18", "--methods", "fedavg",
          "--seeds", "0", "--rounds", "1", "--network", "widen_factor=0.25", "--image-size", "32",
          "--out", "runs/first"], cwd=work, env=env)
    assert "fedavg" in (work / "runs" / "first" / "results.md").read_text()
    assert (work / "runs" / "first" / "results.csv").is_file()
    # the model to export: the shipped bundle trained by MONAI itself, as docs/release.md shows (one epoch, one site)
    shipped = Path(_run([fedlabels_cmd, "bundles", "cxr_resnet18"], cwd=work, env=env).strip())
    assert shipped == site / "fedlabels" / "bundles" / "cxr_resnet18"
    _run([python, "-m", "monai.bundle", "run", "--config_file", shipped / "configs" / "train.json", "--bundle_root",
          shipped, "--dataset_dir", "data/cxr", "--site", "site-1", "--epochs", "1", "--output_dir", "runs/r18",
          "--ckpt_dir", "runs/r18/models"], cwd=work, env=env)
    ckpt = work / "runs" / "r18" / "models" / "model.pt"
    assert ckpt.is_file()
    _run([fedlabels_cmd, "export", "--bundle", "cxr_resnet18", "--ckpt", ckpt, "--data", "data/cxr", "--out",
          "deploy/cxr"], cwd=work, env=env)
    bundle = work / "deploy" / "cxr"
    for rel in ("configs/metadata.json", "configs/inference.json", "models/model.pt", "models/model.ts",
                "docs/README.md", "LICENSE"):
        assert (bundle / rel).is_file(), rel
    images = work / "images"
    images.mkdir()
    for image in sorted((work / "data" / "cxr" / "test" / "images").iterdir())[:6]:
        shutil.copy(image, images)
    _run([python, "-m", "monai.bundle", "run", "--config_file", bundle / "configs" / "inference.json",
          "--bundle_root", bundle, "--dataset_dir", images, "--output_dir", "predictions", "--device", "cpu"],
         cwd=work, env=env)
    rows = (work / "predictions" / "predictions.csv").read_text().strip().splitlines()
    assert len(rows) == 1 + 6, rows

    # the one DICOM decoder, installed: DICOM studies imported with fedlabels import reach the exported bundle's
    # network exactly as training saw them (tests/unit/test_dicom_pixels.py's check, run by this environment's python)
    check = ("import sys, pathlib; sys.path[:0] = [sys.argv[1], str(pathlib.Path(sys.argv[1]).parent)]; "
             "import fedlabels, test_dicom_pixels as t; "
             "assert fedlabels.__file__.startswith(sys.argv[2]), fedlabels.__file__; "
             "print('compared', t.roundtrip(pathlib.Path('dicom-check'), 'auto'))")
    out = _run([python, "-c", check, REPO / "tests" / "unit", env_dir], cwd=work, env=env)
    assert out.strip().splitlines()[-1] == "compared 24", out[-2000:]

    # the job folders go to the current folder (or --out), each with its bundle from the package
    _run([fedlabels_cmd, "jobs", "--name", "fedavg_cxr"], cwd=work, env=env)
    job = work / "nvflare_jobs" / "fedavg_cxr"
    assert (job / "job.py").is_file() and (job / "app" / "custom" / "cxr_densenet121" / "configs" / "metadata.json").is_file()

    after = _files(env_dir)
    assert after == before, {"added": sorted(after.keys() - before.keys()),
                             "changed": sorted(k for k in before if k in after and after[k] != before[k]),
                             "removed": sorted(before.keys() - after.keys())}

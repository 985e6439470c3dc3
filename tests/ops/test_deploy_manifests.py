"""The deployment files under deploy/ are valid and agree with each other and with the code.

Behaviour under test:
* every Kubernetes manifest validates against the Kubernetes JSON schemas (kubernetes-validate,
  strict: unknown fields fail) of 1.28 and of the newest release it ships;
* the MemKV StatefulSet has a headless Service that selects its pods, ports named data/admin,
  probes on /v1/health and /v1/ready, a non-root user (the Dockerfile's), arguments that
  `memkv serve`'s own parser accepts (after Kubernetes' $(VAR) expansion) with an explicit
  --capacity that fits the memory limit, and its key file mounted from the Secret;
* the vLLM pod pattern: PYTHONHASHSEED pinned, IPC_LOCK added, MEMKV_AUTH_KEY from the Secret,
  only MEMKV_* variables the client knows, MEMKV_SERVERS naming exactly the StatefulSet's pods
  by their headless-Service DNS names and data port, a kv-transfer-config whose memkv tier the
  tier's own validation accepts, /dev/shm, memory and store backlog sized to cpu_bytes_to_use,
  and the label the MemKV NetworkPolicy admits;
* its start script, run with bash and a stand-in `vllm`, execs `vllm serve` with the config,
  raises RLIMIT_MEMLOCK to the pool size, and refuses an RDMA setup that cannot pin the pool;
* the Secret template holds no usable key;
* the Dockerfile's final stage runs as a non-root user, exposes 9900 and 9901, starts
  `memkv serve --listen 0.0.0.0:9900` with the key file, and its HEALTHCHECK is `memkv health`
  (run against live plain and TLS nodes in tests/ops/test_cli_health.py);
* the systemd unit passes `systemd-analyze verify` (when available; a structural check
  otherwise), is hardened, and its ExecStart parses.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from memkv import cli, config
from memkv.config import AuthKey, parse_servers, parse_size
from memkv.errors import ConfigError
from memkv.local import LocalNode, new_key_hex
from memkv_vllm.config import TierSettings
from tests.ops.helpers import REPO

DEPLOY = REPO / "deploy"
K8S = DEPLOY / "kubernetes"
K8S_VERSIONS = ("1.28.0", kubernetes_validate.latest_version())
GiB = 1 << 30


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def k8s_docs() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((path.name, doc))
    return out


def one(kind: str, name: str | None = None) -> dict:
    found = [d for _, d in k8s_docs() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def container(workload: dict, name: str) -> dict:
    (c,) = [c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return c


def quantity_bytes(text: str | int) -> int:
    """A Kubernetes memory quantity ("53Gi", "512M", "1e9", 1024) in bytes."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?(?:[eE]\d+)?)(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?", str(text))
    assert m, f"not a memory quantity: {text!r}"
    factor = {
        None: 1,
        "Ki": 1 << 10,
        "Mi": 1 << 20,
        "Gi": 1 << 30,
        "Ti": 1 << 40,
        "Pi": 1 << 50,
        "k": 10**3,
        "M": 10**6,
        "G": 10**9,
        "T": 10**12,
        "P": 10**15,
    }[m.group(2)]
    return int(float(m.group(1)) * factor)


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def k8s_expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of command/args: $(VAR) of a defined variable, $$ -> $."""

    def repl(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", repl, text)


def literal_env(c: dict, field_placeholder: str = "memkv-0") -> dict[str, str]:
    out = {}
    for name, e in env_of(c).items():
        if "value" in e:
            out[name] = str(e["value"])
        elif "fieldRef" in e.get("valueFrom", {}):
            out[name] = field_placeholder
    return out


def serve_args(argv: list[str]):
    """Parse a `memkv ...` argv with the real parser; fails the test on bad usage."""
    try:
        return cli._parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"memkv does not accept {argv}")


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) of each instruction, continuation lines joined, comments dropped."""
    out, buf = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        instr, _, rest = buf.strip().partition(" ")
        out.append((instr.upper(), rest.strip()))
        buf = ""
    return out


def final_stage(instructions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    last_from = max(i for i, (ins, _) in enumerate(instructions) if ins == "FROM")
    return instructions[last_from:]


def exec_form(rest: str) -> list[str]:
    argv = json.loads(rest)
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv), rest
    return argv


def dockerfile_user_uid() -> str:
    stage = final_stage(dockerfile_instructions(DEPLOY / "docker" / "Dockerfile"))
    users = [rest for ins, rest in stage if ins == "USER"]
    assert users, "the final stage sets no USER: the node would run as root"
    return users[-1].split(":")[0]


# --------------------------------------------------------------------------------------------
# Kubernetes
# --------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_the_kubernetes_directory_holds_the_expected_objects() -> None:
    kinds = sorted((d["kind"], d["metadata"]["name"]) for _, d in k8s_docs())
    assert kinds == sorted(
        [
            ("Secret", "memkv-auth"),
            ("Service", "memkv"),
            ("StatefulSet", "memkv"),
            ("PodDisruptionBudget", "memkv"),
            ("NetworkPolicy", "memkv"),
            ("Deployment", "vllm"),
        ]
    )


@pytest.mark.unit
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_validates_against_the_kubernetes_schemas(version: str) -> None:
    problems = []
    for name, doc in k8s_docs():
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = "/".join(str(p) for p in exc.path)
            problems.append(f"{name}: {doc['kind']} {doc['metadata']['name']}: {where}: {exc.message}")
    assert not problems, "\n".join(problems)


@pytest.mark.unit
def test_the_schema_check_rejects_an_unknown_field() -> None:
    sts = one("StatefulSet", "memkv")
    broken = json.loads(json.dumps(sts))
    broken["spec"]["template"]["spec"]["containers"][0]["healthcheck"] = "/v1/health"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)


@pytest.mark.unit
def test_the_statefulset_has_a_headless_service_that_selects_its_pods() -> None:
    sts, svc = one("StatefulSet", "memkv"), one("Service", "memkv")
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    assert svc["spec"]["clusterIP"] == "None"
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    c = container(sts, "memkv")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"data": 9900, "admin": 9901}
    assert {p["name"]: p["targetPort"] for p in svc["spec"]["ports"]} == {"data": "data", "admin": "admin"}
    pdb = one("PodDisruptionBudget", "memkv")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items() and pdb["spec"]["maxUnavailable"] == 1


@pytest.mark.unit
def test_the_memkv_container_runs_serve_as_the_image_user_with_a_capacity_that_fits_its_limit() -> None:
    sts = one("StatefulSet", "memkv")
    c = container(sts, "memkv")
    argv = [k8s_expand(a, literal_env(c)) for a in c["args"]]
    args = serve_args(argv)
    assert args.command == "serve" and args.listen == "0.0.0.0:9900"
    assert args.node_id == "memkv-0", "the node id comes from the pod name"
    assert args.capacity, "--capacity must be explicit in a container (the default sees the host's RAM)"
    capacity = parse_size(args.capacity, "--capacity")
    limit = quantity_bytes(c["resources"]["limits"]["memory"])
    assert limit >= capacity * 1.08 + GiB, (capacity, limit)
    assert quantity_bytes(c["resources"]["requests"]["memory"]) == limit, (
        "request = limit: a cache must not be evicted for memory"
    )
    pod_sc, c_sc = sts["spec"]["template"]["spec"]["securityContext"], c["securityContext"]
    assert pod_sc["runAsNonRoot"] is True and str(pod_sc["runAsUser"]) == dockerfile_user_uid() != "0"
    assert c_sc["allowPrivilegeEscalation"] is False and c_sc["readOnlyRootFilesystem"] is True
    assert c_sc["capabilities"]["drop"] == ["ALL"]
    assert c["livenessProbe"]["httpGet"] == {"path": "/v1/health", "port": "admin"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/v1/ready", "port": "admin"}


@pytest.mark.unit
def test_the_node_key_file_is_the_secret_mounted_read_only() -> None:
    sts, secret = one("StatefulSet", "memkv"), one("Secret", "memkv-auth")
    c = container(sts, "memkv")
    args = serve_args([k8s_expand(a, literal_env(c)) for a in c["args"]])
    (mount,) = [m for m in c["volumeMounts"] if args.key_file.startswith(m["mountPath"].rstrip("/") + "/")]
    assert mount["readOnly"] is True
    (volume,) = [v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    src = volume["secret"]
    assert src["secretName"] == secret["metadata"]["name"]
    (item,) = [i for i in src["items"] if os.path.join(mount["mountPath"], i["path"]) == args.key_file]
    assert item["key"] == config.ENV_AUTH_KEY and item["key"] in secret["stringData"]
    assert src["defaultMode"] & 0o007 == 0, "the key file must not be world-readable"


@pytest.mark.unit
def test_the_secret_template_holds_no_usable_key() -> None:
    secret = one("Secret", "memkv-auth")
    with pytest.raises(ConfigError):
        AuthKey.from_hex(secret["stringData"][config.ENV_AUTH_KEY], config.ENV_AUTH_KEY)


@pytest.mark.unit
def test_vllm_pods_list_exactly_the_statefulset_pods_by_their_headless_dns_names() -> None:
    sts, svc = one("StatefulSet", "memkv"), one("Service", "memkv")
    env = env_of(container(one("Deployment", "vllm"), "vllm"))
    servers = parse_servers(env[config.ENV_SERVERS]["value"], config.ENV_SERVERS)
    name, service = sts["metadata"]["name"], svc["metadata"]["name"]
    pods = []
    for s in servers:
        # <pod>.<service> (same namespace) or <pod>.<service>.<namespace>.svc.<cluster domain>
        parts = s.host.split(".")
        assert len(parts) == 2 or (len(parts) >= 5 and parts[3] == "svc"), (
            f"{s.host} is not a headless-Service DNS name"
        )
        assert parts[1] == service, f"{s.host} is not under the headless Service {service}"
        pods.append(parts[0])
    assert pods == [f"{name}-{i}" for i in range(sts["spec"]["replicas"])], "every StatefulSet pod, in order"
    data_port = {p["name"]: p["port"] for p in svc["spec"]["ports"]}["data"]
    assert {s.port for s in servers} == {data_port}


@pytest.mark.unit
def test_vllm_pods_pin_the_hash_seed_and_take_memkv_settings_from_the_secret() -> None:
    vllm, secret = one("Deployment", "vllm"), one("Secret", "memkv-auth")
    env = env_of(container(vllm, "vllm"))
    assert re.fullmatch(r"\d+", env["PYTHONHASHSEED"]["value"]), "PYTHONHASHSEED must be pinned to a number"
    ref = env[config.ENV_AUTH_KEY]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]
    unknown = {n for n in env if n.startswith("MEMKV_")} - set(config.CLIENT_ENV_VARS)
    assert not unknown, f"MEMKV_* variables the client does not read: {unknown}"
    pod_labels = vllm["spec"]["template"]["metadata"]["labels"]
    policy = one("NetworkPolicy", "memkv")
    data_rules = [r for r in policy["spec"]["ingress"] if any(p["port"] == 9900 for p in r.get("ports", []))]
    assert any(
        f["podSelector"]["matchLabels"].items() <= pod_labels.items() for r in data_rules for f in r.get("from", [])
    )


def kv_transfer_config() -> dict:
    env = env_of(container(one("Deployment", "vllm"), "vllm"))
    return json.loads(env["KV_TRANSFER_CONFIG"]["value"])


@pytest.mark.unit
def test_the_kv_transfer_config_has_a_memkv_tier_the_tier_accepts() -> None:
    cfg = kv_transfer_config()
    assert cfg["kv_connector"] == "OffloadingConnector" and cfg["kv_role"] == "kv_both"
    extra = cfg["kv_connector_extra_config"]
    assert extra["spec_name"] == "TieringOffloadingSpec"
    (tier,) = [t for t in extra["secondary_tiers"] if t["type"] == "memkv"]
    settings = TierSettings.from_tier_config({k: v for k, v in tier.items() if k != "type"})
    backlog = settings.store_backlog_bytes(extra["cpu_bytes_to_use"])
    assert backlog <= extra["cpu_bytes_to_use"] / 2, "keep max_store_backlog_mb below half the pool"
    assert extra["block_size"] % 16 == 0


@pytest.mark.unit
def test_the_vllm_pod_has_room_for_the_cpu_pool_in_shm_memory_and_memlock() -> None:
    vllm = one("Deployment", "vllm")
    c = container(vllm, "vllm")
    pool = kv_transfer_config()["kv_connector_extra_config"]["cpu_bytes_to_use"]
    assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
    (shm_mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (shm,) = [v for v in vllm["spec"]["template"]["spec"]["volumes"] if v["name"] == shm_mount["name"]]
    assert shm["emptyDir"]["medium"] == "Memory"
    shm_bytes = quantity_bytes(shm["emptyDir"]["sizeLimit"])
    assert shm_bytes >= pool
    assert quantity_bytes(c["resources"]["limits"]["memory"]) >= shm_bytes + 8 * GiB
    script = c["args"][0]
    assert c["command"][0] == "/bin/bash" and "$KV_TRANSFER_CONFIG" in script and "ulimit -S -l" in script


# --------------------------------------------------------------------------------------------
# The vLLM start script, run for real with a stand-in `vllm`
# --------------------------------------------------------------------------------------------


def vllm_script_env(tmp_path: Path, extra: dict[str, str] | None = None) -> tuple[list[str], dict[str, str], Path]:
    c = container(one("Deployment", "vllm"), "vllm")
    lit = literal_env(c)
    argv = [k8s_expand(a, lit) for a in c["command"] + c["args"]]
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir(exist_ok=True)
    out = tmp_path / "vllm-argv.json"
    fake = fake_bin / "vllm"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\njson.dump(sys.argv[1:], open({str(out)!r}, 'w'))\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    (fake_bin / "python3").symlink_to(sys.executable)
    env = {"PATH": f"{fake_bin}:{os.environ['PATH']}", **{k: v for k, v in lit.items()}, **(extra or {})}
    return argv, env, out


@pytest.mark.integration
def test_the_vllm_start_script_raises_memlock_to_the_pool_and_execs_vllm_serve(tmp_path: Path) -> None:
    argv, env, out = vllm_script_env(tmp_path)
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    args = json.loads(out.read_text())
    assert args[:2] == ["serve", env["MODEL"]]
    assert json.loads(args[args.index("--kv-transfer-config") + 1]) == kv_transfer_config()
    assert "RLIMIT_MEMLOCK" in proc.stderr and "CPU pool" in proc.stderr


def can_drop_capabilities() -> bool:
    if not (shutil.which("capsh") and shutil.which("prlimit")):
        return False
    probe = subprocess.run(
        ["prlimit", "--memlock=65536:65536", "capsh", "--drop=cap_ipc_lock,cap_sys_resource", "--", "-c", "true"],
        capture_output=True,
        timeout=10,
    )
    return probe.returncode == 0


@pytest.mark.integration
@pytest.mark.skipif(not can_drop_capabilities(), reason="needs capsh and prlimit with the right to use them")
@pytest.mark.parametrize("rdma", [True, False])
def test_the_vllm_start_script_refuses_rdma_when_the_pool_cannot_be_pinned(tmp_path: Path, rdma: bool) -> None:
    extra = {config.ENV_RDMA_DEVICES: "mlx5_0"} if rdma else {}
    argv, env, out = vllm_script_env(tmp_path, extra)
    # A 64 KiB hard memlock limit, and neither IPC_LOCK nor the right to raise the limit.
    wrapped = [
        "prlimit",
        "--memlock=65536:65536",
        "capsh",
        "--drop=cap_ipc_lock,cap_sys_resource",
        "--",
        "-c",
        " ".join(shlex.quote(a) for a in ["exec", *argv]),
    ]
    proc = subprocess.run(wrapped, env=env, capture_output=True, text=True, timeout=30)
    if rdma:
        assert proc.returncode == 1 and not out.exists()
        assert "IPC_LOCK" in proc.stderr and "cpu_bytes_to_use" in proc.stderr
    else:
        assert proc.returncode == 0 and out.exists(), proc.stderr
        assert "warning" in proc.stderr and "TCP" in proc.stderr


# --------------------------------------------------------------------------------------------
# Docker
# --------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_the_dockerfile_runs_serve_as_a_non_root_user_on_both_ports() -> None:
    stage = final_stage(dockerfile_instructions(DEPLOY / "docker" / "Dockerfile"))
    uid = dockerfile_user_uid()
    assert uid not in ("0", "root") and uid.isdigit(), "USER must be a numeric non-root uid (runAsNonRoot checks it)"
    exposed = {int(p.split("/")[0]) for ins, rest in stage if ins == "EXPOSE" for p in rest.split()}
    assert {9900, 9901} <= exposed
    (entrypoint,) = [exec_form(rest) for ins, rest in stage if ins == "ENTRYPOINT"]
    (cmd,) = [exec_form(rest) for ins, rest in stage if ins == "CMD"]
    argv = entrypoint + cmd
    assert argv[0] == "memkv"
    args = serve_args(argv[1:])
    assert args.command == "serve" and args.listen == "0.0.0.0:9900" and args.key_file == "/etc/memkv/auth.key"
    instructions = dockerfile_instructions(DEPLOY / "docker" / "Dockerfile")
    build_args = dict(
        rest.split("=", 1)
        for ins, rest in instructions[: instructions.index(next(i for i in instructions if i[0] == "FROM"))]
        if ins == "ARG"
    )
    base = re.sub(r"\$\{(\w+)\}", lambda m: build_args[m.group(1)], stage[0][1])
    assert base.startswith("python:3.11-slim"), f"the runtime stage should start from a small python base, not {base}"


def healthcheck_argv() -> list[str]:
    stage = final_stage(dockerfile_instructions(DEPLOY / "docker" / "Dockerfile"))
    (hc,) = [rest for ins, rest in stage if ins == "HEALTHCHECK"]
    options, _, cmd = hc.partition("CMD ")
    assert "--timeout=" in options and "--interval=" in options
    return exec_form(cmd)


@pytest.mark.unit
def test_the_dockerfile_healthcheck_is_memkv_health() -> None:
    """`memkv health` finds the admin port and TLS in the node's own command line; it runs
    against real plain and TLS nodes, as Docker runs it, in tests/ops/test_cli_health.py."""
    argv = healthcheck_argv()
    assert argv == ["memkv", "health"]
    assert cli._parser().parse_args(argv[1:]).func is cli.health.cmd_health


@pytest.mark.integration
def test_the_image_command_serves_with_the_mounted_key_file_and_refuses_without_one(tmp_path: Path) -> None:
    from memkv import Client, ClientConfig
    from memkv.config import ServerAddress

    key = new_key_hex()
    key_file = tmp_path / "auth.key"
    key_file.write_text(key + "\n")
    key_file.chmod(0o400)
    # The image's CMD with a loopback address: MEMKV_AUTH_KEY unset (LocalNode passes it empty).
    node = LocalNode("", capacity="64MiB", extra_args=["--key-file", str(key_file)])
    try:
        cfg = ClientConfig(servers=(ServerAddress(node.host, node.port),), auth_key=AuthKey.from_hex(key, "test"))
        with Client(cfg) as client:
            assert len(client.probe()) == 1
    finally:
        node.stop()
    missing = subprocess.run(
        [
            sys.executable,
            "-m",
            "memkv",
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--capacity",
            "64MiB",
            "--key-file",
            str(tmp_path / "absent.key"),
        ],
        env={k: v for k, v in os.environ.items() if k != config.ENV_AUTH_KEY},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert missing.returncode == 2
    assert "--key-file" in missing.stderr and "cannot read key file" in missing.stderr


@pytest.mark.unit
def test_the_vllm_image_installs_this_package_on_a_vllm_base() -> None:
    inst = dockerfile_instructions(DEPLOY / "docker" / "Dockerfile.vllm")
    assert any(ins == "FROM" for ins, _ in inst)
    assert any(ins == "ARG" and rest.startswith("VLLM_IMAGE=vllm/vllm-openai:") for ins, rest in inst)
    runs = " ".join(rest for ins, rest in inst if ins == "RUN")
    assert "pip install" in runs and "memkv_tier" in runs


# --------------------------------------------------------------------------------------------
# systemd
# --------------------------------------------------------------------------------------------

UNIT = DEPLOY / "systemd" / "memkv.service"


def unit_sections(text: str) -> dict[str, list[tuple[str, str]]]:
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1]
            sections.setdefault(current, [])
            continue
        assert current is not None and "=" in line, f"not a unit file line: {raw!r}"
        key, _, value = line.partition("=")
        sections[current].append((key.strip(), value.strip()))
    return sections


@pytest.mark.unit
def test_the_systemd_unit_is_hardened_and_takes_the_key_from_an_environment_file() -> None:
    sections = unit_sections(UNIT.read_text())
    assert set(sections) == {"Unit", "Service", "Install"}
    service = dict(sections["Service"])
    assert service.get("DynamicUser") == "yes" or service.get("User") not in (None, "root")
    assert service["ProtectSystem"] in ("strict", "full") and service["NoNewPrivileges"] == "yes"
    assert service["ProtectHome"] in ("yes", "read-only", "tmpfs")
    assert service["EnvironmentFile"].lstrip("-").startswith("/etc/memkv/")
    assert service["RestartPreventExitStatus"] == "2", "a configuration error must not restart in a loop"
    exec_start = shlex.split(service["ExecStart"])
    assert exec_start[0].endswith("/memkv")
    args = serve_args(exec_start[1:])
    assert args.command == "serve" and args.capacity and args.key_file is None  # key from MEMKV_AUTH_KEY
    env_example = (DEPLOY / "systemd" / "memkv.env.example").read_text()
    assert re.search(rf"^{config.ENV_AUTH_KEY}=\s*$", env_example, re.M), "the example must hold no key"


def verifiable_unit(tmp_path: Path) -> Path:
    memkv_bin = shutil.which("memkv") or str(Path(sys.executable).with_name("memkv"))
    unit = tmp_path / "memkv.service"
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/memkv", memkv_bin))
    return unit


@pytest.mark.unit
@pytest.mark.skipif(
    not shutil.which("systemd-analyze"), reason="systemd-analyze is not installed (the structural test covers the unit)"
)
def test_the_systemd_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    unit = verifiable_unit(tmp_path)
    proc = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    complaints = [line for line in (proc.stdout + proc.stderr).splitlines() if unit.name in line or "memkv" in line]
    assert proc.returncode == 0 and not complaints, proc.stdout + proc.stderr


@pytest.mark.unit
@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze is not installed")
def test_the_systemd_unit_exposure_score_is_low(tmp_path: Path) -> None:
    unit = verifiable_unit(tmp_path)
    proc = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", str(unit)], capture_output=True, text=True, timeout=60
    )
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", proc.stdout + proc.stderr)
    if proc.returncode != 0 and not m:
        pytest.skip(f"this systemd-analyze cannot score offline units: {proc.stderr.strip()[:200]}")
    assert m and float(m.group(1)) <= 2.0, proc.stdout[-2000:]


# --------------------------------------------------------------------------------------------
# The TLS variant (deploy/kubernetes/tls/)
# --------------------------------------------------------------------------------------------

K8S_TLS = K8S / "tls"


def tls_docs() -> list[tuple[str, dict]]:
    return [
        (path.name, doc)
        for path in sorted(K8S_TLS.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


def tls_one(kind: str, name: str) -> dict:
    (found,) = [d for _, d in tls_docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


@pytest.mark.unit
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_tls_variant_validates_against_the_kubernetes_schemas(version: str) -> None:
    docs = tls_docs()
    assert sorted((d["kind"], d["metadata"]["name"]) for _, d in docs) == [
        ("Secret", "memkv-tls"),
        ("StatefulSet", "memkv"),
    ]
    for _name, doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.unit
def test_the_tls_statefulset_is_the_plain_one_plus_tls_and_https_probes() -> None:
    plain, tls = one("StatefulSet", "memkv"), tls_one("StatefulSet", "memkv")
    # It replaces the plain StatefulSet: same selector, Service and pod labels, same container
    # bounds; only the arguments, the probes' scheme and the TLS volume differ.
    for field in ("serviceName", "selector", "replicas", "podManagementPolicy"):
        assert tls["spec"][field] == plain["spec"][field], field
    assert tls["spec"]["template"]["metadata"]["labels"] == plain["spec"]["template"]["metadata"]["labels"]
    pc, tc = container(plain, "memkv"), container(tls, "memkv")
    for field in ("image", "ports", "resources", "securityContext", "env"):
        assert tc[field] == pc[field], field
    assert tc["livenessProbe"]["httpGet"] == {"path": "/v1/health", "port": "admin", "scheme": "HTTPS"}
    assert tc["readinessProbe"]["httpGet"] == {"path": "/v1/ready", "port": "admin", "scheme": "HTTPS"}
    args = serve_args([k8s_expand(a, literal_env(tc)) for a in tc["args"]])
    plain_args = serve_args([k8s_expand(a, literal_env(pc)) for a in pc["args"]])
    assert (args.listen, args.capacity, args.key_file) == (plain_args.listen, plain_args.capacity, plain_args.key_file)
    assert args.tls_listen is None, "the data port itself is TLS-only"
    secret = tls_one("Secret", "memkv-tls")
    assert secret["type"] == "kubernetes.io/tls"
    volumes = {v["name"]: v for v in tls["spec"]["template"]["spec"]["volumes"]}
    for path, key in ((args.tls_cert, "tls.crt"), (args.tls_key, "tls.key"), (args.tls_ca, "ca.crt")):
        (mount,) = [m for m in tc["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
        assert mount["readOnly"] is True
        src = volumes[mount["name"]]["secret"]
        assert src["secretName"] == "memkv-tls" and src["defaultMode"] & 0o007 == 0
        (item,) = [i for i in src["items"] if os.path.join(mount["mountPath"], i["path"]) == path]
        assert item["key"] == key and key in secret["stringData"]
    # Secret volumes are read-only: a mount nested inside another one could not be created.
    mounts = [m["mountPath"].rstrip("/") + "/" for m in tc["volumeMounts"]]
    assert not any(a != b and b.startswith(a) for a in mounts for b in mounts), mounts


@pytest.mark.unit
def test_the_tls_secret_template_is_refused_by_the_node(tmp_path: Path) -> None:
    secret = tls_one("Secret", "memkv-tls")
    for key in ("tls.crt", "tls.key", "ca.crt"):
        (tmp_path / key).write_text(secret["stringData"][key])
    from memkv.tls import server_context

    with pytest.raises(ConfigError, match="not a PEM certificate"):
        server_context(str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"), str(tmp_path / "ca.crt"))


@pytest.mark.integration
def test_the_tls_variants_probes_pass_against_a_live_tls_node(tmp_path: Path) -> None:
    """What the kubelet does for `scheme: HTTPS`: TLS without verifying the certificate, then GET."""
    import ssl
    import urllib.request

    from tests.tlscerts import session_pki

    pki = session_pki()
    tc = container(tls_one("StatefulSet", "memkv"), "memkv")
    with LocalNode(
        new_key_hex(),
        capacity="64MiB",
        extra_args=["--tls-cert", pki.server.cert, "--tls-key", pki.server.key, "--tls-ca", pki.ca],
    ) as node:
        kubelet = ssl.create_default_context()
        kubelet.check_hostname = False
        kubelet.verify_mode = ssl.CERT_NONE
        for probe in ("livenessProbe", "readinessProbe"):
            get = tc[probe]["httpGet"]
            url = f"{get['scheme'].lower()}://127.0.0.1:{node.admin_port}{get['path']}"
            with urllib.request.urlopen(url, timeout=5, context=kubelet) as resp:
                assert resp.status == 200

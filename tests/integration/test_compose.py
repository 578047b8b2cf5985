"""docker-compose.yml: valid for docker-compose (offline `config`), every command accepted by our CLI
parser, and the addresses the services use to reach each other match the ports they listen on."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from llmserve.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
SERVERS = ("tokenizer", "worker", "router")


@pytest.fixture(scope="module")
def config() -> dict:
    exe = shutil.which("docker-compose")
    if exe is None:
        # .ci/run installs it, so in CI a missing one is a failure, not a reason to skip.
        assert not os.environ.get("CI"), "docker-compose is missing under CI (.ci/run installs Debian's package)"
        pytest.skip("docker-compose is not installed (Debian: apt-get install -y docker-compose)")
    try:
        result = subprocess.run([exe, "-f", "docker-compose.yml", "config"], cwd=REPO, capture_output=True, text=True,
                                timeout=60)
    except OSError as exc:
        pytest.skip(f"docker-compose cannot run here: {exc}")
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def _parse(cmd: list[str]):
    assert cmd[0] == "llmserve", cmd
    try:
        return build_parser().parse_args(cmd[1:])
    except SystemExit as exc:  # argparse rejects with exit code 2
        raise AssertionError(f"llmserve rejects {cmd}") from exc


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def test_compose_file_is_valid_and_commands_parse(config: dict) -> None:
    services = config["services"]
    assert {"model", "tokenizer", "worker-0", "router"} <= set(services)
    parsed = {name: _parse(svc["command"]) for name, svc in services.items()}
    assert {a.command for a in parsed.values()} == {"fetch-model", "tokenizer", "worker", "router"}
    for name, args in parsed.items():
        svc = services[name]
        assert svc["image"] == "llmserve:latest" and svc["build"]["dockerfile"] == "docker/Dockerfile"
        if args.command not in SERVERS:
            continue
        # In a container a server listens on the compose network; the healthcheck probes it there.
        assert args.host == "0.0.0.0"
        test = svc["healthcheck"]["test"]
        assert test[0] == "CMD"
        health = _parse(test[1:])
        assert health.command == "health" and health.address == f"127.0.0.1:{args.port}", (name, test)
    assert (REPO / "docker" / "Dockerfile").is_file()


def test_compose_addresses_match_listening_ports(config: dict) -> None:
    services = config["services"]
    parsed = {name: _parse(svc["command"]) for name, svc in services.items()}
    by_host = {}
    for name, svc in services.items():
        for host in {name, svc.get("hostname", name)}:
            by_host[host] = name

    def target(address: str, command: str) -> str:
        host, port = _split(address)
        assert host in by_host, f"{address}: no service or hostname {host!r}"
        name = by_host[host]
        args = parsed[name]
        assert args.command == command and args.port == port, f"{address} is {name}, which runs {args}"
        assert str(port) in [str(p) for p in services[name].get("expose", [])], (name, port)
        return name

    (router,) = [n for n, a in parsed.items() if a.command == "router"]
    r = parsed[router]
    deps = services[router]["depends_on"]
    needed = [target(r.tokenizer, "tokenizer")] + [target(w, "worker") for w in r.workers]
    # Tensor-parallel followers: same group (init address), same engine flags, distinct ranks.
    for leader in [n for n in needed if parsed[n].command == "worker"]:
        group = [n for n, a in parsed.items() if a.command == "worker"
                 and a.dist_init_addr == parsed[leader].dist_init_addr]
        ranks = sorted(parsed[n].tp_rank for n in group)
        assert ranks == list(range(parsed[leader].tp_size)) and parsed[leader].tp_rank == 0, group
        assert all(parsed[n].tp_size == parsed[leader].tp_size and parsed[n].model == parsed[leader].model
                   for n in group)
        host, port = _split(parsed[leader].dist_init_addr)
        assert by_host[host] == leader and str(port) in [str(p) for p in services[leader]["expose"]]
        needed += [n for n in group if n != leader]
    # Every tokenizer and worker service is one the router uses (directly, or as a follower rank).
    assert {n for n, a in parsed.items() if a.command in ("tokenizer", "worker")} == set(needed)
    for name in needed:
        assert deps[name]["condition"] == "service_healthy", (name, deps)
    # Only the router is published, on the host's loopback, at the port it listens on.
    published = [(p["host_ip"], int(p["published"]), int(p["target"])) if isinstance(p, dict)
                 else _published(p) for p in services[router]["ports"]]
    assert published == [("127.0.0.1", r.port, r.port)]
    assert all("ports" not in s for n, s in services.items() if n != router)
    # The model the init service writes is the one the servers load, through the shared volume.
    (model_out,) = [str(a.out) for a in parsed.values() if a.command == "fetch-model"]
    for name, args in parsed.items():
        if args.command in ("tokenizer", "worker"):
            assert args.model == model_out
            mounts = services[name]["volumes"]
            assert any(model_out.startswith(m.split(":")[1] if isinstance(m, str) else m["target"]) for m in mounts)
            assert services[name]["depends_on"]["model"]["condition"] == "service_completed_successfully"
    assert "models" in config["volumes"]


def _published(spec: str) -> tuple[str, int, int]:
    """'127.0.0.1:30000:30000/tcp' -> ('127.0.0.1', 30000, 30000)."""
    host_ip, host_port, container = spec.split("/")[0].split(":")
    return host_ip, int(host_port), int(container)

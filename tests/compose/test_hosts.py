"""omni across two hosts with plain compose (deploy/host: docker-compose.yml
with deploy/tls.yml and deploy/hosts.yml over it), as a user without Swarm
runs it (tests/compose/run, after the compose test, whose image it uses).

The two hosts are two compose projects on this engine: each has its own
networks, so their containers meet only through ports published on the
host's address, as on two machines. Host A runs the coordinator, the router
and w0, with the certificates made there (omnictl certs, the CA's key
kept); host B runs w1 and c0 with a copy of the certificates without the
CA's key. Every gRPC connection is mutual TLS.
"""

import json
import os
import shutil
import subprocess
import tempfile
import time

import pytest

from stackutil import BASE, IMAGE, MODEL_NAME, ROOT, Api, free_port, run, set_up_once

HOST = os.path.join(ROOT, "deploy", "host")
OMNICTL = os.path.join(ROOT, "target", "release", "omnictl")
PROJECTS = {"a": f"omni-host-a-{os.getpid()}", "b": f"omni-host-b-{os.getpid()}"}


def host_address():
    """This machine's address on its default route: what another host
    would reach it at."""
    out = run("ip", "-4", "route", "get", "1.1.1.1").stdout.split()
    return out[out.index("src") + 1]

# A failed set-up, so that the next tests say so at once.
FAILED = []


class Hosts(Api):
    def __init__(self):
        self.ip = host_address()
        self.dirs = {h: tempfile.mkdtemp(prefix=f"omni-host-{h}-") for h in PROJECTS}
        self.port = free_port()
        # The certificates are made on host A (the operator's omnictl) and
        # copied to B without the CA's key.
        run(OMNICTL, "certs", "--out", os.path.join(self.dirs["a"], "certs"))
        shutil.copytree(
            os.path.join(self.dirs["a"], "certs"),
            os.path.join(self.dirs["b"], "certs"),
            ignore=shutil.ignore_patterns("ca.key"),
        )
        self.outputs = {}
        # B first: its workers wait for the coordinator; A's coordinator
        # is healthy once B's workers have registered.
        self.host("b", ["w1", "c0"], OMNI_COORDINATOR_HOST=self.ip)
        self.host("a", ["coordinator", "router", "w0"])
        self.key = open(os.path.join(self.dirs["a"], "api_keys")).read().strip()
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def env(self, h, **extra):
        env = dict(
            os.environ,
            COMPOSE_PROJECT_NAME=PROJECTS[h],
            OMNI_HOST=self.ip,
            OMNI_PORT=str(self.port),
            OMNI_IMAGE=IMAGE,
            OMNI_BUILD_BASE=BASE,
            OMNI_SECRETS=self.dirs[h],
            OMNI_MODEL_NAME=MODEL_NAME,
            OMNI_CTX="1024",
            OMNI_SEQS="4",
            OMNI_LOAD_GRACE="180s",
            **extra,
        )
        env.pop("COMPOSE_PROFILES", None)
        return env

    def host(self, h, services, **extra):
        t = time.monotonic()
        r = subprocess.run(
            [HOST, *services, "--model", os.environ["OMNI_TEST_MODEL"]],
            capture_output=True, text=True, timeout=900, env=self.env(h, **extra),
        )
        self.outputs[h] = r.stdout + r.stderr
        print(f"\nhost {h}: deploy/host {' '.join(services)} took {time.monotonic() - t:.1f} s:\n{self.outputs[h]}")
        if r.returncode != 0:
            self.logs()
            self.clean_up()
            raise AssertionError(f"deploy/host on host {h} failed ({r.returncode})")

    def containers(self, h):
        ids = run("docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECTS[h]}").stdout.split()
        return {
            json.loads(run("docker", "inspect", i).stdout)[0]["Config"]["Labels"]["com.docker.compose.service"]: i
            for i in ids
        }

    def logs(self):
        for h in PROJECTS:
            for service, cid in self.containers(h).items():
                r = run("docker", "logs", "--tail", "60", cid, check=False)
                print(f"--- host {h}: {service} ---\n{r.stdout}{r.stderr}")

    def down(self, h):
        return subprocess.run([HOST, "--down"], capture_output=True, text=True, timeout=300, env=self.env(h))


    def clean_up(self):
        for h in PROJECTS:
            if self.containers(h):
                self.down(h)
        for d in self.dirs.values():
            shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def hosts():
    s = set_up_once(FAILED, Hosts)
    yield s
    s.clean_up()


def test_the_two_halves_meet_only_through_the_hosts_address(hosts):
    a, b = hosts.containers("a"), hosts.containers("b")
    assert set(a) == {"coordinator", "router", "w0"} and set(b) == {"w1", "c0"}, (a, b)
    nets = {
        h: {n for cid in c.values() for n in json.loads(run("docker", "inspect", cid).stdout)[0]["NetworkSettings"]["Networks"]}
        for h, c in [("a", a), ("b", b)]
    }
    assert not nets["a"] & nets["b"], nets
    # Host B used the copied certificates, without the CA's key.
    assert "the CA's key is not here" in hosts.outputs["b"], hosts.outputs["b"]
    # Each worker is reached at its host's address and published port.
    r = run("docker", "exec", a["coordinator"], "omnictl", "workers", "--json")
    addrs = {w["id"]: w["addr"] for w in json.loads(r.stdout)}
    assert addrs["w0"] == f"{hosts.ip}:50051" and addrs["w1"] == f"{hosts.ip}:50052", addrs
    # (The plan leaves the expert worker idle for a dense model, and the
    # list shows the workers it places: c0's registration says where.)
    logs = run("docker", "logs", a["coordinator"], check=False)
    assert f"c0 registered from {hosts.ip}:50061" in logs.stdout + logs.stderr


def test_a_chat_completion_across_the_two_hosts(hosts):
    hosts.assert_answers()


def test_the_published_ports_take_only_the_clusters_certificates(hosts):
    certs = os.path.join(hosts.dirs["a"], "certs")
    coordinator = f"{hosts.ip}:7070"
    # Without certificates: refused, and told why.
    r = run(OMNICTL, "generate", "--coordinator", coordinator, "--prompt", "Hello", "-n", "4", check=False, timeout=60)
    assert r.returncode != 0 and "requires mutual TLS" in r.stdout + r.stderr, r
    # The operator's certificate from the same CA: served.
    tls = ["--tls-ca", f"{certs}/ca.pem", "--tls-cert", f"{certs}/omnictl.pem", "--tls-key", f"{certs}/omnictl.key"]
    r = run(OMNICTL, *tls, "generate", "--coordinator", coordinator, "--prompt", "Hello", "-n", "4", timeout=60)
    assert r.stdout.strip(), r
    # A worker port, with another cluster's certificate: refused.
    other = tempfile.mkdtemp(prefix="omni-other-ca-")
    try:
        run(OMNICTL, "certs", "--out", other, "--names", "omnictl")
        bad = ["--tls-ca", f"{other}/ca.pem", "--tls-cert", f"{other}/omnictl.pem", "--tls-key", f"{other}/omnictl.key"]
        r = run(OMNICTL, *bad, "generate", "--coordinator", coordinator, "--prompt", "Hello", "-n", "4", check=False, timeout=60)
        assert r.returncode != 0, r
    finally:
        shutil.rmtree(other, ignore_errors=True)
    logs = run("docker", "logs", hosts.containers("a")["coordinator"], check=False)
    text = logs.stdout + logs.stderr
    assert "mutual TLS on" in text
    assert "refused a plaintext connection" in text


def test_down_on_each_host_leaves_nothing(hosts):
    for h in PROJECTS:
        r = hosts.down(h)
        assert r.returncode == 0, r.stdout + r.stderr
        label = f"label=com.docker.compose.project={PROJECTS[h]}"
        assert run("docker", "ps", "-aq", "--filter", label).stdout.strip() == ""
        assert run("docker", "network", "ls", "-q", "--filter", label).stdout.strip() == ""

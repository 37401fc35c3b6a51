"""omni's stack on Docker Swarm, one node, checked as a user would see it
(tests/compose/run, after the compose test, whose image it deploys).

The module makes this engine a Swarm manager if it is not one (and leaves
the swarm at the end, `docker swarm leave --force`, only then), deploys
deploy/swarm.yml over deploy/docker-compose.yml with deploy/swarm serving
Gemma 3 270M under its own stack name on a free port, mutual TLS on, and
the last test removes it and checks that nothing is left.
"""

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

import pytest

from stackutil import (
    set_up_once,
    BASE,
    IMAGE,
    MODEL_NAME,
    ROOT,
    Api,
    assert_no_route_out,
    free_port,
    inspect,
    run,
    stream_through_crash,
)

SWARM = os.path.join(ROOT, "deploy", "swarm")
STACK = f"omni-swarm-{os.getpid()}"
SERVICES = {"coordinator", "w0", "w1", "c0", "router"}


def swarm_state():
    return run("docker", "info", "-f", "{{.Swarm.LocalNodeState}}").stdout.strip()

# A failed set-up, so that the next tests say so at once.
FAILED = []


class Stack(Api):
    def __init__(self):
        self.made_swarm = swarm_state() != "active"
        if self.made_swarm:
            # One node; the loopback address keeps the test off the host's
            # other interfaces.
            run("docker", "swarm", "init", "--advertise-addr", "127.0.0.1")
        self.port = free_port()
        self.secrets = tempfile.mkdtemp(prefix="omni-swarm-secrets-")
        self.env = dict(
            os.environ,
            OMNI_STACK=STACK,
            OMNI_PORT=str(self.port),
            OMNI_IMAGE=IMAGE,
            OMNI_BUILD_BASE=BASE,
            OMNI_SECRETS=self.secrets,
            OMNI_MODEL_NAME=MODEL_NAME,
            OMNI_CTX="1024",
            OMNI_SEQS="4",
            OMNI_LOAD_GRACE="180s",
        )
        self.env.pop("COMPOSE_PROFILES", None)
        t = time.monotonic()
        r = subprocess.run(
            [SWARM, os.environ["OMNI_TEST_MODEL"]],
            capture_output=True, text=True, timeout=1500, env=self.env,
        )
        self.up_output = r.stdout + r.stderr
        print(f"\ndeploy/swarm took {time.monotonic() - t:.1f} s:\n{self.up_output}")
        if r.returncode != 0:
            self.logs()
            self.clean_up()
            raise AssertionError(f"deploy/swarm failed ({r.returncode})")
        self.key = open(os.path.join(self.secrets, "api_keys")).read().strip()
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def containers(self, all_=False):
        """service -> id of its running task's container (with all_, every
        task's: service -> [ids], newest first)."""
        args = ["docker", "ps", "-q", "--filter", f"label=com.docker.stack.namespace={STACK}"]
        if all_:
            args.insert(2, "-a")
        out = {}
        for cid in run(*args).stdout.split():
            service = inspect("container", cid)["Config"]["Labels"]["com.docker.swarm.service.name"]
            out.setdefault(service[len(STACK) + 1:], []).append(cid)
        return out if all_ else {s: ids[0] for s, ids in out.items()}

    def logs(self):
        for service in SERVICES:
            r = run("docker", "service", "logs", "--tail", "60", f"{STACK}_{service}", check=False)
            print(f"--- {service} ---\n{r.stdout}{r.stderr}")

    def down(self):
        return subprocess.run([SWARM, "--down"], capture_output=True, text=True, timeout=300, env=self.env)


    def clean_up(self):
        if self.containers(all_=True):
            self.down()
        shutil.rmtree(self.secrets, ignore_errors=True)
        if self.made_swarm:
            run("docker", "swarm", "leave", "--force", check=False)


@pytest.fixture(scope="module")
def stack():
    s = set_up_once(FAILED, Stack)
    yield s
    if s.containers(all_=True):
        s.logs()
    s.clean_up()


def wait_healthy(cid, what, seconds=120):
    deadline = time.monotonic() + seconds
    while inspect("container", cid)["State"]["Health"]["Status"] != "healthy":
        assert time.monotonic() < deadline, f"{what} did not become healthy"
        time.sleep(1)


def test_every_service_runs_one_healthy_task_from_the_image_built_here(stack):
    services = {
        s["Spec"]["Name"][len(STACK) + 1:]: s
        for s in json.loads(
            run("docker", "service", "inspect", *[f"{STACK}_{n}" for n in SERVICES]).stdout
        )
    }
    assert set(services) == SERVICES
    for name, s in services.items():
        spec = s["Spec"]
        task = spec["TaskTemplate"]
        assert task["ContainerSpec"]["Image"] == IMAGE, name
        # Names resolve to the task itself (no IPVS virtual IP), and a task
        # that exits is replaced.
        assert spec["EndpointSpec"]["Mode"] == "dnsrr", name
        assert task["RestartPolicy"]["Condition"] == "any", name
    c = stack.containers()
    assert set(c) == SERVICES, c
    for name, cid in c.items():
        wait_healthy(cid, name, 60)
        assert inspect("container", cid)["Config"]["User"] == "65532:65532", name
    # Workers are placed by node label; this one node carries them all.
    for w in ["w0", "w1", "c0"]:
        constraints = services[w]["Spec"]["TaskTemplate"]["Placement"]["Constraints"]
        assert constraints == [f"node.labels.omni.{w} == true"], (w, constraints)
    assert services["router"]["Spec"]["TaskTemplate"]["Placement"]["Constraints"] == ["node.role == manager"]


def test_a_chat_completion_through_the_published_port(stack):
    stack.assert_answers()
    status, body = stack.post("/chat/completions", {"model": MODEL_NAME, "messages": []}, key="sk-wrong")
    assert status == 401, body


def test_the_secrets_are_swarm_secrets_and_the_keys_only_the_image_user_reads(stack):
    names = set(run("docker", "secret", "ls", "--format", "{{.Name}}").stdout.split())
    want = {"api_keys", "admin_token", "tls_ca"} | {
        f"tls_{s}_{k}" for s in ["coordinator", "router", "w0", "w1", "c0"] for k in ["cert", "key"]
    }
    assert {f"{STACK}_{n}" for n in want} <= names, names
    # A profile's services that are not deployed take no secret.
    assert f"{STACK}_tls_g0_key" not in names
    for service in SERVICES:
        spec = inspect("service", f"{STACK}_{service}")["Spec"]["TaskTemplate"]["ContainerSpec"]
        files = {s["File"]["Name"]: s for s in spec.get("Secrets", [])}
        assert {"tls_ca.pem", "tls_cert.pem", "tls_key.pem"} <= set(files), (service, files)
        key = files["tls_key.pem"]
        assert key["SecretName"] == f"{STACK}_tls_{service}_key", (service, key)
        assert (key["File"]["UID"], key["File"]["Mode"]) == ("65532", 0o400), (service, key)
    # The admin console in the coordinator's container: its token and its
    # certificate are the mounted secrets (the admin API is TLS too).
    r = run("docker", "exec", stack.containers()["coordinator"], "omnictl", "workers", "--json")
    workers = {w["id"]: w for w in json.loads(r.stdout)}
    assert [workers["w0"]["stage"], workers["w1"]["stage"]] == [0, 1], workers


def test_every_grpc_connection_is_mutual_tls_and_a_peer_without_the_certificate_is_refused(stack):
    c = stack.containers()
    for service in SERVICES:
        logs = run("docker", "service", "logs", f"{STACK}_{service}", check=False)
        assert "mutual TLS on" in logs.stdout + logs.stderr, service
    # omnictl from the image, on the brain network (w0's network namespace)
    # but without the cluster's certificate: the coordinator refuses it and
    # says why, on both sides.
    r = run(
        "docker", "run", "--rm", "--network", f"container:{c['w0']}", IMAGE,
        "omnictl", "generate", "--coordinator", "coordinator:7070", "--prompt", "Hello", "-n", "4",
        check=False, timeout=60,
    )
    assert r.returncode != 0, r.stdout
    assert "requires mutual TLS" in r.stdout + r.stderr, r.stdout + r.stderr
    logs = run("docker", "service", "logs", f"{STACK}_coordinator", check=False)
    assert "refused a plaintext connection" in logs.stdout + logs.stderr


def test_the_brain_network_is_an_internal_encrypted_overlay_with_no_route_out(stack):
    brain = inspect("network", f"{STACK}_brain")
    public = inspect("network", f"{STACK}_public")
    assert (brain["Driver"], brain["Internal"]) == ("overlay", True), brain
    assert brain["Options"].get("encrypted") == "true", brain["Options"]
    assert (public["Driver"], public["Internal"]) == ("overlay", False)
    # Every service is on brain only; the router also on public.
    names = {brain["Id"]: "brain", public["Id"]: "public"}
    for service in SERVICES:
        spec = inspect("service", f"{STACK}_{service}")["Spec"]["TaskTemplate"]
        on = {names.get(n["Target"], n["Target"]) for n in spec.get("Networks", [])}
        assert on == ({"brain", "public"} if service == "router" else {"brain"}), (service, on)
    c = stack.containers()
    assert_no_route_out({s: c[s] for s in ["coordinator", "w0", "w1", "c0"]}, c["router"], "coordinator")
    # Only the router is published, in host mode on the node.
    for service in SERVICES:
        ports = inspect("service", f"{STACK}_{service}")["Spec"].get("EndpointSpec", {}).get("Ports", [])
        if service == "router":
            assert [(p["TargetPort"], p["PublishedPort"], p["PublishMode"]) for p in ports] == [
                (8080, stack.port, "host")
            ], ports
        else:
            assert ports == [], (service, ports)


def test_a_killed_worker_is_replaced_and_the_stream_in_flight_completes(stack):
    before = stack.containers()["w1"]
    pause = stream_through_crash(stack, before, "omni-gpu-worker", 160, 40)
    print(f"\nlongest pause in the stream (w1 killed, replaced by Swarm, recovered): {pause:.2f} s")
    # Swarm replaced the task: a new container, healthy.
    deadline = time.monotonic() + 60
    while stack.containers()["w1"] == before:
        assert time.monotonic() < deadline, "Swarm did not replace w1's task"
        time.sleep(1)
    wait_healthy(stack.containers()["w1"], "w1's new task")
    tasks = run("docker", "service", "ps", "--format", "{{.CurrentState}}", f"{STACK}_w1").stdout.splitlines()
    assert len(tasks) >= 2 and any(t.startswith("Failed") for t in tasks), tasks
    status, out = stack.hello()
    assert status == 200, out


def test_down_leaves_nothing(stack):
    r = stack.down()
    assert r.returncode == 0, r.stdout + r.stderr
    label = f"label=com.docker.stack.namespace={STACK}"
    for kind in ["service", "network", "secret"]:
        assert run("docker", kind, "ls", "-q", "--filter", label).stdout.strip() == "", kind
    assert run("docker", "ps", "-aq", "--filter", label).stdout.strip() == ""
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        urllib.request.urlopen(stack.url + "/models", timeout=5)

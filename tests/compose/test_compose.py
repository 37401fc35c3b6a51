"""omni's compose stack, checked as a user would see it (tests/compose/run).

One stack for the whole module: deploy/up builds the image (base
omni-base:bookworm, the host's binaries) and starts deploy/docker-compose.yml
under its own project name, serving Gemma 3 270M and, as its Executor (a
second model with its own coordinator and worker), Qwen2.5-Coder 0.5B on a
free port; the last test takes it down and checks that nothing is left.
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
    BASE,
    IMAGE,
    MODEL_NAME,
    ROOT,
    Api,
    assert_no_route_out,
    inspect,
    run,
    stream_through_crash,
    free_port,
)

UP = os.path.join(ROOT, "deploy", "up")
PROJECT = f"omni-ci-{os.getpid()}"
EXECUTOR_NAME = "coder"
# The router's auto rules: code to the Executor, long prompts and the rest
# to the first model.
AUTO = f"keyword:code={EXECUTOR_NAME};prompt_chars>400={MODEL_NAME};default={MODEL_NAME}"


class Stack(Api):
    def __init__(self):
        self.port = free_port()
        self.secrets = tempfile.mkdtemp(prefix="omni-secrets-")
        model = os.environ["OMNI_TEST_MODEL"]
        executor = os.environ["OMNI_TEST_EXECUTOR"]
        self.env = dict(
            os.environ,
            COMPOSE_PROJECT_NAME=PROJECT,
            OMNI_PORT=str(self.port),
            OMNI_IMAGE=IMAGE,
            OMNI_BUILD_BASE=BASE,
            OMNI_SECRETS=self.secrets,
            OMNI_MODEL_NAME=MODEL_NAME,
            OMNI_EXECUTOR_NAME=EXECUTOR_NAME,
            OMNI_AUTO=AUTO,
            OMNI_CTX="1024",
            OMNI_SEQS="4",
        )
        self.env.pop("COMPOSE_PROFILES", None)
        t = time.monotonic()
        r = subprocess.run(
            [UP, model, executor], capture_output=True, text=True, timeout=1500, env=self.env
        )
        self.up_seconds = time.monotonic() - t
        self.up_output = r.stdout + r.stderr
        print(f"\ndeploy/up took {self.up_seconds:.1f} s:\n{self.up_output}")
        if r.returncode != 0:
            self.logs()
            raise AssertionError(f"deploy/up failed ({r.returncode})")
        self.key = open(os.path.join(self.secrets, "api_keys")).read().strip()
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def containers(self, all_=False):
        """service name -> container id, for this project."""
        args = ["docker", "ps", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}"]
        if all_:
            args.insert(2, "-a")
        ids = run(*args).stdout.split()
        return {inspect("container", i)["Config"]["Labels"]["com.docker.compose.service"]: i for i in ids}

    def logs(self):
        for service, cid in self.containers(all_=True).items():
            r = run("docker", "logs", "--tail", "60", cid, check=False)
            print(f"--- {service} ---\n{r.stdout}{r.stderr}")

    def down(self):
        return subprocess.run([UP, "--down"], capture_output=True, text=True, timeout=300, env=self.env)


@pytest.fixture(scope="module")
def stack():
    s = Stack()
    yield s
    if s.containers(all_=True):
        s.logs()
        s.down()
    shutil.rmtree(s.secrets, ignore_errors=True)


def test_every_container_is_healthy_by_its_own_exec_form_check(stack):
    c = stack.containers()
    assert set(c) == {"coordinator", "w0", "w1", "c0", "executor", "e0", "router"}, c
    for service, cid in c.items():
        info = inspect("container", cid)
        test = info["Config"]["Healthcheck"]["Test"]
        assert test[0] == "CMD" and test[2] == "healthcheck", (service, test)
        deadline = time.monotonic() + 60
        while info["State"]["Health"]["Status"] != "healthy" and time.monotonic() < deadline:
            time.sleep(1)
            info = inspect("container", cid)
        health = info["State"]["Health"]
        assert health["Status"] == "healthy", (service, health["Log"][-1:])
        assert health["Log"][-1]["ExitCode"] == 0
        assert info["Config"]["Image"] == IMAGE
        assert info["Config"]["User"] == "65532:65532", service
    # The coordinators' check asks for the Inference service, not just a
    # listening port: its last probe says so.
    for service in ["coordinator", "executor"]:
        out = inspect("container", c[service])["State"]["Health"]["Log"][-1]["Output"]
        assert "omni.coordinator.v1.Inference SERVING" in out, (service, out)


def test_the_image_has_no_shell_no_curl_and_only_what_the_binaries_need(stack):
    cid = run("docker", "create", IMAGE).stdout.strip()
    try:
        files = run("bash", "-c", f"docker export {cid} | tar -t").stdout.split()
    finally:
        run("docker", "rm", cid)
    names = {f.rstrip("/").rsplit("/", 1)[-1] for f in files}
    for tool in ["sh", "bash", "dash", "busybox", "curl", "wget", "apt", "apt-get", "dpkg"]:
        assert tool not in names, f"{tool} is in the image"
    for b in ["omni-coordinator", "omni-gpu-worker", "omni-cpu-worker", "omni-router", "omnictl"]:
        assert f"usr/local/bin/{b}" in files
    # llama.cpp's libraries beside them, and ggml's CPU backends, one per
    # x86 level (the workers load the best one for the host's CPU).
    for lib in ["libllama.so.0", "libggml.so.0", "libggml-base.so.0",
                "libggml-cpu-x64.so", "libggml-cpu-haswell.so", "libggml-cpu-zen4.so"]:
        assert f"usr/local/bin/{lib}" in files, lib
    allowed = ("usr/local/bin/", "lib/", "lib64/", "usr/lib/", "etc/", "dev/", "proc/", "sys/",
               "tmp/", "models/", "home/", ".dockerenv")
    stray = [f for f in files if not f.endswith("/") and not f.startswith(allowed)]
    assert not stray, stray
    r = run("docker", "run", "--rm", "--entrypoint", "/bin/sh", IMAGE, "-c", "true", check=False)
    assert r.returncode != 0 and "no such file" in (r.stdout + r.stderr).lower(), r


def test_a_chat_completion_through_the_published_port(stack):
    stack.assert_answers()
    # The key from the secret file is what lets it in.
    status, body = stack.post("/chat/completions", {"model": MODEL_NAME, "messages": []}, key="sk-wrong")
    assert status == 401, body


def test_both_models_answer_under_their_names_and_auto_routes_between_them(stack):
    # deploy/up planned both together before starting them.
    assert f"2 models planned together ({MODEL_NAME}, {EXECUTOR_NAME})" in stack.up_output, stack.up_output
    status, listed = stack.get("/models")
    assert status == 200, listed
    assert {MODEL_NAME, EXECUTOR_NAME, "auto"} <= {m["id"] for m in listed["data"]}, listed
    for name in [MODEL_NAME, EXECUTOR_NAME]:
        status, body = stack.post(
            "/completions",
            {"model": name, "prompt": "def fibonacci(n):", "max_tokens": 8, "temperature": 0},
        )
        assert status == 200 and body["model"] == name, body
        assert body["usage"]["completion_tokens"] > 0, body
    for prompt, want in [
        ("Write some code that sorts a list.", EXECUTOR_NAME),
        ("Tell me about the sea. " * 20, MODEL_NAME),
        ("Hello there.", MODEL_NAME),
    ]:
        status, body = stack.post(
            "/completions", {"model": "auto", "prompt": prompt, "max_tokens": 4, "temperature": 0}
        )
        assert status == 200, body
        assert body["model"] == want, (prompt, body["model"])
    # Each model's admin console runs in its own coordinator's container.
    r = run("docker", "exec", stack.containers()["executor"], "omnictl", "workers", "--json")
    assert [w["id"] for w in json.loads(r.stdout)] == ["e0"], r.stdout


def test_the_admin_console_runs_inside_the_coordinator_container(stack):
    # The admin API listens on the coordinator's loopback only; omnictl in
    # the same image reaches it, with the token from the secret file.
    r = run("docker", "exec", stack.containers()["coordinator"], "omnictl", "workers", "--json")
    workers = {w["id"]: w for w in json.loads(r.stdout)}
    # (For a dense model the plan leaves c0 unused, and the list shows only
    # the workers the plan places.)
    assert {"w0", "w1"} <= set(workers), workers
    assert [workers["w0"]["stage"], workers["w1"]["stage"]] == [0, 1], workers
    # Each worker computes with a ggml CPU variant chosen for this host.
    for w in ["w0", "w1"]:
        assert workers[w]["cpu_variant"] and workers[w]["cpu_features"], workers[w]


def test_the_brain_network_is_internal_and_only_the_router_is_published(stack):
    brain = inspect("network", f"{PROJECT}_brain")
    public = inspect("network", f"{PROJECT}_public")
    assert brain["Internal"] is True
    assert public["Internal"] is False
    for service, cid in stack.containers().items():
        info = inspect("container", cid)
        published = {
            port: binds
            for port, binds in (info["NetworkSettings"]["Ports"] or {}).items()
            if binds
        }
        networks = set(info["NetworkSettings"]["Networks"])
        if service == "router":
            assert published == {"8080/tcp": [{"HostIp": "127.0.0.1", "HostPort": str(stack.port)}]}, published
            assert networks == {f"{PROJECT}_brain", f"{PROJECT}_public"}
        else:
            assert published == {}, (service, published)
            assert networks == {f"{PROJECT}_brain"}, (service, networks)


def test_nothing_on_the_brain_network_reaches_outside(stack):
    c = stack.containers()
    assert_no_route_out(
        {s: c[s] for s in ["coordinator", "w0", "c0", "executor", "e0"]}, c["router"], "coordinator"
    )


def test_a_killed_worker_is_restarted_and_the_stream_in_flight_completes(stack):
    w1 = stack.containers()["w1"]
    before = inspect("container", w1)
    pause = stream_through_crash(stack, w1, "omni-gpu-worker", 160, 40)
    print(f"\nlongest pause in the stream (w1 killed, restarted by compose, recovered): {pause:.2f} s")

    after = inspect("container", w1)
    assert after["RestartCount"] > before["RestartCount"], "compose did not restart w1"
    assert after["State"]["StartedAt"] != before["State"]["StartedAt"]
    deadline = time.monotonic() + 60
    while inspect("container", w1)["State"]["Health"]["Status"] != "healthy":
        assert time.monotonic() < deadline, "w1 did not become healthy again"
        time.sleep(1)
    # And the cluster serves new requests afterwards.
    status, out = stack.hello()
    assert status == 200, out


def test_a_crashed_coordinator_is_restarted_keeps_its_workers_and_the_stream_in_flight_completes(stack):
    """Issue 42: the coordinator is killed (-9) mid-stream. Compose starts
    it again; the workers outlive it (no restart, no load: they register
    with the new process, which keeps their stages) and the router resumes
    the stream on it with the tokens it would have had."""
    c = stack.containers()
    before = {s: inspect("container", c[s])["RestartCount"] for s in ["coordinator", "w0", "w1", "c0"]}
    pause = stream_through_crash(stack, c["coordinator"], "omni-coordinator", 120, 30)
    print(f"\nlongest pause in the stream (coordinator killed, restarted by compose, request resumed): {pause:.2f} s")
    assert inspect("container", c["coordinator"])["RestartCount"] > before["coordinator"], "compose did not restart the coordinator"
    for s in ["w0", "w1", "c0"]:
        assert inspect("container", c[s])["RestartCount"] == before[s], f"{s} was restarted: it should outlive the coordinator"
    for s in ["w0", "w1"]:
        logs = run("docker", "logs", c[s], check=False)
        assert "registering with the new one" in logs.stdout + logs.stderr
        assert "kept" in logs.stdout + logs.stderr, f"{s} loaded its stage again"
    status, out = stack.hello()
    assert status == 200, out


def test_down_leaves_nothing_running(stack):
    r = stack.down()
    assert r.returncode == 0, r.stdout + r.stderr
    label = f"label=com.docker.compose.project={PROJECT}"
    assert run("docker", "ps", "-aq", "--filter", label).stdout.strip() == ""
    assert run("docker", "network", "ls", "-q", "--filter", label).stdout.strip() == ""
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        urllib.request.urlopen(stack.url + "/models", timeout=5)

"""What the compose test and the Swarm test share: running docker, the
OpenAI API as a client sees it, probes from inside a container's network,
and crashing a process the way a fault would."""

import json
import os
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
IMAGE = "omni:compose-test"
BASE = "omni-base:bookworm"
MODEL_NAME = "gemma3-270m"
# An address outside the brain network that the host reaches: the Debian
# archive this machine installs from (deploy/base-image.sh needs it too).
OUTSIDE_NAME = "deb.debian.org"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(*args, check=True, timeout=600, env=None):
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
    return r


def inspect(kind, name):
    return json.loads(run("docker", kind, "inspect", name).stdout)[0]


def set_up_once(failures, make):
    """`make()` for a module's fixture, unless an earlier try in this run
    failed: then that failure again at once (pytest would set the fixture
    up anew for each test, and a stack that did not come up takes minutes
    to say so)."""
    if failures:
        raise AssertionError(f"the stack did not come up (above): {failures[0]}")
    try:
        return make()
    except BaseException as e:
        failures.append(str(e) or type(e).__name__)
        raise


class Api:
    """The router's OpenAI API at `url` with the key `key`."""

    url = ""
    key = ""

    def get(self, path):
        req = urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {self.key}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())

    def post(self, path, body, key=None, timeout=120):
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={
                "Content-Type": "application/json",
                "Authorization": f"Bearer {key or self.key}",
            },
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def stream(self, body, on_chunk=None, timeout=300):
        """A streamed chat completion: (text, finish_reason, chunk times)."""
        req = urllib.request.Request(
            self.url + "/chat/completions",
            data=json.dumps(dict(body, stream=True)).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.key}"},
        )
        text, finish, times = [], None, []
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for line in r:
                line = line.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise AssertionError(f"the stream ended with an error: {chunk['error']}")
                choice = chunk["choices"][0]
                piece = choice.get("delta", {}).get("content") or ""
                if piece:
                    text.append(piece)
                    times.append(time.monotonic())
                    if on_chunk:
                        on_chunk(len(text))
                finish = choice.get("finish_reason") or finish
        return "".join(text), finish, times

    def assert_answers(self):
        """A greedy chat completion answers with some text, every token
        counted."""
        status, body = self.post(
            "/chat/completions",
            {
                "model": MODEL_NAME,
                "messages": [{"role": "user", "content": "Name three rivers in Europe."}],
                "max_tokens": 24,
                "temperature": 0,
            },
        )
        assert status == 200, body
        assert body["choices"][0]["message"]["content"].strip(), body
        assert body["usage"]["completion_tokens"] > 0, body

    def hello(self):
        """A short chat completion; its status and body."""
        return self.post(
            "/chat/completions",
            {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8},
        )


def probe(container, script):
    """Runs `script` in bash inside `container`'s network namespace (its
    addresses, routes and DNS resolver): the runtime image has no shell, so
    the probe brings its own (the base image, joined to the container's
    network with --network container:ID)."""
    return run(
        "docker", "run", "--rm", "--network", f"container:{container}", BASE,
        "bash", "-c", script, check=False, timeout=60,
    )


def dns(container):
    return probe(container, f"getent hosts {OUTSIDE_NAME}")


def tcp(container, ip, port=80):
    return probe(container, f"timeout 5 bash -c 'exec 3<>/dev/tcp/{ip}/{port}' && echo connected")


def assert_no_route_out(containers, control, inside_name):
    """Nothing in `containers` (name -> id) resolves or reaches the outside
    address, while `control` (a container also on a network that routes
    out) does both: so the failures are the brain network's doing. Names
    inside the brain network (`inside_name`) still resolve."""
    outside_ip = socket.gethostbyname(OUTSIDE_NAME)
    r = dns(control)
    assert r.returncode == 0 and r.stdout.strip(), f"control DNS from the router failed: {r}"
    r = tcp(control, outside_ip)
    assert "connected" in r.stdout, f"control TCP from the router failed: {r}"
    for service, cid in containers.items():
        r = dns(cid)
        assert r.returncode != 0 and not r.stdout.strip(), f"{service} resolved {OUTSIDE_NAME}: {r.stdout}"
        r = tcp(cid, outside_ip)
        assert "connected" not in r.stdout, f"{service} reached {outside_ip}:80"
        r = probe(cid, f"getent hosts {inside_name}")
        assert r.returncode == 0 and r.stdout.strip(), f"{service}: {r}"


def crash(container, binary):
    """SIGKILL to `binary`'s process in `container` (its host pid from
    `docker top`): a crash, not an operator's stop. `docker kill` counts as
    a manual stop, which restart policies leave stopped."""
    top = run("docker", "top", container, "-eo", "pid,args").stdout.splitlines()[1:]
    pid = next(int(l.split()[0]) for l in top if binary in l.split(None, 1)[1])
    run(*([] if os.geteuid() == 0 else ["sudo"]), "kill", "-9", str(pid))


def stream_through_crash(api, container, binary, max_tokens, at):
    """A greedy story streamed once undisturbed, then again with `binary`
    in `container` crashed after `at` chunks: the second must complete
    with the same text. The longest pause it saw."""
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    clean, finish, _ = api.stream(body)
    assert finish == "length" and clean
    killed = threading.Event()

    def kill_at(n):
        if n == at and not killed.is_set():
            killed.set()
            crash(container, binary)

    text, finish, times = api.stream(body, on_chunk=kill_at)
    assert killed.is_set()
    assert finish == "length"
    assert text == clean, f"the stream that lived through the crash of {binary} differs from the clean one"
    return max(b - a for a, b in zip(times, times[1:]))

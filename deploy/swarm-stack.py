#!/usr/bin/env python3
"""Turns the compose model of docker-compose.yml with swarm.yml over it (the
output of `docker compose config`, JSON or YAML, on stdin) into a stack file
for `docker stack deploy` (JSON, which it reads as YAML, on stdout).

`docker stack deploy` reads compose files of format 3 and refuses or
ignores what compose alone has; so this:
  - keeps the services of the profiles in COMPOSE_PROFILES (default cpu) and
    those without a profile (stack deploy has no profiles);
  - drops what Swarm does not have: build, restart (deploy.restart_policy
    instead), depends_on (Swarm starts every service at once; each omni
    process waits for the ones it needs), cpuset, the device reservations
    (node labels and NVIDIA_VISIBLE_DEVICES instead, swarm.yml);
  - publishes ports in host mode on the node's interfaces (dnsrr services
    cannot use Swarm's routing mesh, and Swarm binds no host address);
  - keeps only the secrets a kept service uses, and mounts each private key
    (target tls_key.pem, tls.yml) for the image's user only (compose would
    ignore an owner and a mode, and 1.29 warns about each).
Deploy it with `deploy/swarm` (which runs this); by hand:
  docker compose -f docker-compose.yml -f swarm.yml config | python3 swarm-stack.py | docker stack deploy -c - omni
"""

import json
import os
import sys

# Service keys Swarm has no use for (see above); `docker stack deploy`
# refuses cpuset and the device reservations outright.
DROPPED = ["build", "restart", "depends_on", "profiles", "cpuset", "container_name"]
# The image's user (deploy/Dockerfile's USER).
IMAGE_USER = "65532"


def load(text):
    try:
        return json.loads(text)
    except ValueError:
        # Debian's docker-compose 1.29 prints YAML only; it is Python and
        # brings PyYAML.
        import yaml

        return yaml.safe_load(text)


def port(p):
    """A port of the compose model, short ("127.0.0.1:8080:8080/tcp") or long,
    as Swarm's long form in host mode."""
    if isinstance(p, dict):
        out = {"target": int(p["target"]), "protocol": p.get("protocol", "tcp"), "mode": "host"}
        if p.get("published"):
            out["published"] = int(p["published"])
        return out
    spec, _, proto = str(p).partition("/")
    parts = spec.split(":")
    out = {"target": int(parts[-1]), "protocol": proto or "tcp", "mode": "host"}
    if len(parts) > 1 and parts[-2]:
        out["published"] = int(parts[-2])
    return out


def drop_devices(s):
    """Drops the device reservations, and the mappings they leave empty
    (other empty mappings mean something: `networks: {brain: {}}`)."""
    resources = s.get("deploy", {}).get("resources", {})
    reservations = resources.get("reservations", {})
    reservations.pop("devices", None)
    if "reservations" in resources and not reservations:
        del resources["reservations"]
    if "resources" in s.get("deploy", {}) and not resources:
        del s["deploy"]["resources"]


def main():
    model = load(sys.stdin.read())
    profiles = {p for p in os.environ.get("COMPOSE_PROFILES", "cpu").split(",") if p}
    services = {}
    for name, s in model.get("services", {}).items():
        if s.get("profiles") and not profiles & set(s["profiles"]):
            continue
        for key in DROPPED:
            s.pop(key, None)
        drop_devices(s)
        if s.get("ports"):
            s["ports"] = [port(p) for p in s["ports"]]
        for secret in s.get("secrets", []):
            if isinstance(secret, dict) and secret.get("target") == "tls_key.pem":
                secret.update(uid=IMAGE_USER, gid=IMAGE_USER, mode=0o400)
        services[name] = s
    if not services:
        sys.exit(f"swarm-stack: no service in the profiles {sorted(profiles)}")
    used = {
        (x if isinstance(x, str) else x["source"])
        for s in services.values()
        for x in s.get("secrets", [])
    }
    model["services"] = services
    model["secrets"] = {k: v for k, v in model.get("secrets", {}).items() if k in used}
    model["version"] = "3.9"
    json.dump(model, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()

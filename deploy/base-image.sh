#!/usr/bin/env bash
# Builds omni-base:bookworm, a minimal Debian 12 root filesystem made with
# debootstrap and loaded with `docker import`, for machines that can reach
# Debian's package archive but no container registry. deploy/Dockerfile
# takes it as its BASE build argument (see tests/compose/run); the image
# users pull by default (rust:1-bookworm) is the same Debian release.
#
#   deploy/base-image.sh [TAG]      (default omni-base:bookworm; kept if present,
#                                    OMNI_BASE_REBUILD=1 makes it again)
# Needs root (or sudo) for debootstrap; installs debootstrap if missing.
set -euo pipefail
tag=${1:-omni-base:bookworm}
suite=bookworm
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
# libgomp1: the binaries link OpenMP (ggml's CPU threads); the rest of what
# they link (libc, libstdc++, libgcc) is already in minbase.
include=libgomp1,ca-certificates

if [ -z "${OMNI_BASE_REBUILD:-}" ] && docker image inspect "$tag" >/dev/null 2>&1; then
    echo "base-image: $tag is present (OMNI_BASE_REBUILD=1 to make it again)"
    exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
if ! command -v debootstrap >/dev/null; then
    echo "base-image: installing debootstrap (apt)"
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null \
        || { $sudo apt-get update -qq && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null; }
fi
root=$(mktemp -d "${TMPDIR:-/tmp}/omni-rootfs.XXXXXX")
trap '$sudo rm -rf "$root"' EXIT
echo "base-image: debootstrap $suite (minbase + $include) from $mirror"
start=$SECONDS
$sudo debootstrap --variant=minbase --include="$include" "$suite" "$root" "$mirror" \
    > "$root.log" 2>&1 || { tail -30 "$root.log"; echo "base-image: debootstrap failed (log above)"; exit 1; }
rm -f "$root.log"
# What an image does not need: package caches and lists, docs, man pages.
$sudo rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* \
    "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/*
echo "base-image: debootstrap took $((SECONDS - start)) s; importing as $tag"
$sudo tar -C "$root" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' - "$tag" >/dev/null
docker image ls "$tag"

#!/usr/bin/env bash
# Runs in deploy/Dockerfile's builder stage (in /src, the repository):
# builds omni's binaries, or takes them prebuilt, then lays out the runtime
# image's whole filesystem in $1: the binaries in /usr/local/bin with
# llama.cpp's shared libraries beside them (libllama, libggml, libggml-base and
# ggml's CPU backends, one per x86 level, chosen at run time: the binaries
# find them through their $ORIGIN rpath), the system libraries they link
# (found with ldd, so nothing else: no shell, no curl, no package manager), a
# user, /tmp and /models.
#
# Where the binaries come from:
#   - cargo on PATH (the default base, rust:1-bookworm, or a CUDA base with
#     Rust): cargo build --release --locked here; CUDA=1 then also builds
#     ggml's CUDA backend, libggml-cuda.so, with the CUDA runtime libraries
#     it links, beside them (scripts/build-cuda: the base's CUDA toolkit, or
#     CUDA 13 from PyPI), which the engine loads at run time;
#   - no cargo (omni-base:bookworm from deploy/base-image.sh, on machines
#     without a registry): deploy/.prebuilt/, filled by tests/compose/run
#     from the host's target/release (same Debian release, same glibc).
set -euo pipefail
out=${1:?usage: build.sh ROOTFS}
bins=(omni-coordinator omni-gpu-worker omni-cpu-worker omni-router omnictl)
cuda=${CUDA:-0}

if command -v cargo >/dev/null; then
    need=()
    command -v cmake >/dev/null || need+=(cmake)
    command -v clang >/dev/null || need+=(clang libclang-dev)
    # CUDA from PyPI wheels when the base has no nvcc (scripts/build-cuda).
    if [ "$cuda" = 1 ] && ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ]; then
        python3 -m pip --version >/dev/null 2>&1 || need+=(python3-pip)
    fi
    if [ ${#need[@]} -gt 0 ]; then
        echo "build.sh: installing ${need[*]} (apt)"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
    fi
    echo "build.sh: cargo build --release (CUDA=$cuda)"
    cargo build --release --locked \
        -p omni-coordinator -p omni-gpu-worker -p omni-cpu-worker -p omni-router -p omnictl --bins
    if [ "$cuda" = 1 ]; then
        echo "build.sh: scripts/build-cuda (ggml's CUDA backend)"
        scripts/build-cuda
    fi
    from=target/release
elif [ -x deploy/.prebuilt/omni-coordinator ]; then
    [ "$cuda" = 1 ] && { echo "build.sh: CUDA=1 needs a base with cargo (the default rust:1-bookworm; CUDA itself comes from PyPI when the base has none)" >&2; exit 1; }
    echo "build.sh: no cargo in this base: taking the binaries from deploy/.prebuilt"
    from=deploy/.prebuilt
else
    echo "build.sh: this base has no cargo and deploy/.prebuilt/ has no binaries." >&2
    echo "  Build with a Rust base (the default rust:1-bookworm), or run tests/compose/run," >&2
    echo "  which fills deploy/.prebuilt from the host's cargo build." >&2
    exit 1
fi

mkdir -p "$out/usr/local/bin" "$out/etc" "$out/models" "$out/tmp" "$out/home/omni"
chmod 1777 "$out/tmp"
for b in "${bins[@]}"; do
    install -m 0755 "$from/$b" "$out/usr/local/bin/$b"
    # Without the line tables (about 4x smaller; symbols stay for backtraces).
    if command -v strip >/dev/null; then strip --strip-debug "$out/usr/local/bin/$b"; fi
done
# llama.cpp and ggml (the engine's build puts them beside the binaries):
# linked by soname (lib*.so.0), and the backends ggml loads (libggml-*.so).
libs=()
for f in "$from"/lib*.so.[0-9]* "$from"/libggml-*.so; do
    [ -f "$f" ] || continue
    install -m 0644 "$f" "$out/usr/local/bin/"
    libs+=("$out/usr/local/bin/$(basename "$f")")
done
if ! ls "$out"/usr/local/bin/libggml-cpu-*.so >/dev/null 2>&1; then
    echo "build.sh: no ggml CPU backends (libggml-cpu-*.so) beside the binaries in $from" >&2
    exit 1
fi
# A device backend that needs a system library this base lacks (ggml-vulkan
# needs libvulkan.so.1, which neither rust:1-bookworm nor omni-base has) is
# left out, and said: ggml loads the backends it finds, so the image still
# runs on the CPU (and on CUDA where that backend is here). A Vulkan image
# needs a base with libvulkan1 and the GPU's Vulkan driver.
kept=()
for lib in "${libs[@]}"; do
    case "$(basename "$lib")" in
        libggml-vulkan.so)
            lacks=$(LD_LIBRARY_PATH="$out/usr/local/bin" ldd "$lib" | awk '/not found/ { print $1 }' | paste -sd ' ' -)
            if [ -n "$lacks" ]; then
                echo "build.sh: leaving out $(basename "$lib"): this base has no $lacks (a Vulkan image needs libvulkan1 and the GPU's Vulkan driver)"
                rm -f "$lib"
                continue
            fi ;;
    esac
    kept+=("$lib")
done
libs=("${kept[@]}")
# The libraries: what ldd resolves for each binary, at the same path (the
# loader included). The NVIDIA driver's own libraries (libcuda, NVML) are
# not copied: the NVIDIA container runtime mounts the host's.
missing=()
for path in "${bins[@]/#/$out/usr/local/bin/}" "${libs[@]}"; do
    while read -r line; do
        case "$line" in
            *"not found"*)
                lib=${line%% *}
                case "$lib" in libcuda.so*|libnvidia-ml.so*) ;; *) missing+=("$path: $lib") ;; esac
                continue ;;
        esac
        for f in $line; do
            case "$f" in
                "$out"/*) ;; # ours, already in place
                /*) [ -e "$f" ] || continue
                    mkdir -p "$out$(dirname "$f")"
                    cp -L "$f" "$out$f" ;;
            esac
        done
    # The backends find libggml-base beside them (dlopen'ed by a binary that
    # already has it loaded); ldd needs the directory said.
    done < <(LD_LIBRARY_PATH="$out/usr/local/bin" ldd "$path")
done
if [ ${#missing[@]} -gt 0 ]; then
    printf 'build.sh: a library the binaries need is not in this base: %s\n' "${missing[@]}" >&2
    exit 1
fi
# The unprivileged user the services run as (uid 65532, as distroless).
printf 'root:x:0:0:root:/root:/nonexistent\nomni:x:65532:65532:omni:/home/omni:/nonexistent\n' > "$out/etc/passwd"
printf 'root:x:0:\nomni:x:65532:\n' > "$out/etc/group"
chown 65532:65532 "$out/home/omni"
echo "build.sh: runtime filesystem:"
(cd "$out" && find . -type f -printf '%s %p\n' | sort -k2 | awk '{ printf "  %8.1f MiB  %s\n", $1 / 1048576, $2 }')

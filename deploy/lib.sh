# What deploy/up (compose on one host) and deploy/swarm (Docker Swarm) share;
# sourced by both, with $here set to deploy/.

# `docker compose` (v2), else Debian's `docker-compose` (1.29), on
# docker-compose.yml and the files given.
compose=(docker compose)
docker compose version >/dev/null 2>&1 || compose=(docker-compose)
command -v "${compose[0]}" >/dev/null || { echo "$0: neither 'docker compose' nor 'docker-compose' is installed" >&2; exit 1; }
dc() { "${compose[@]}" --project-directory "$here" -f "$here/docker-compose.yml" "$@"; }

# The model to serve: $1 (a GGUF file) or $OMNI_MODELS/$OMNI_MODEL_FILE;
# exports OMNI_MODELS, OMNI_MODEL_FILE and OMNI_MODEL_NAME.
use_model() {
    if [ -n "${1:-}" ]; then
        [ -f "$1" ] || { echo "$0: $1 is not a file" >&2; exit 1; }
        export OMNI_MODELS=$(cd "$(dirname "$1")" && pwd)
        export OMNI_MODEL_FILE=$(basename "$1")
        # A split model's name is its prefix, not one part's.
        export OMNI_MODEL_NAME=${OMNI_MODEL_NAME:-$(basename "$1" .gguf | sed -E 's/-[0-9]{5}-of-[0-9]{5}$//')}
    fi
    export OMNI_MODELS=${OMNI_MODELS:-$HOME/.cache/omni/models}
    export OMNI_MODEL_FILE=${OMNI_MODEL_FILE:-gemma3-270m-q4_k_m.gguf}
    if [ ! -f "$OMNI_MODELS/$OMNI_MODEL_FILE" ]; then
        echo "$0: no model at $OMNI_MODELS/$OMNI_MODEL_FILE" >&2
        echo "  give a GGUF file ($0 PATH/TO/MODEL.gguf), or fetch the test model:" >&2
        echo "  ./scripts/omnictl fetch gemma3-270m" >&2
        exit 1
    fi
}

# The API key and the admin token in $OMNI_SECRETS (default deploy/secrets),
# made on first use: files, never in an image. Sets $secrets.
make_secrets() {
    secrets=${OMNI_SECRETS:-$here/secrets}
    export OMNI_SECRETS=$secrets
    mkdir -p "$secrets"
    chmod 700 "$secrets"
    new_secret api_keys sk-omni-
    new_secret admin_token ""
}

new_secret() {
    # Readable inside the containers (uid 65532 reads the bind-mounted file);
    # the folder's 0700 keeps other host users out.
    [ -s "$secrets/$1" ] && return
    (umask 022; printf '%s%s\n' "$2" "$(od -An -N24 -tx1 /dev/urandom | tr -d ' \n')" > "$secrets/$1")
    echo "$(basename "$0"): made $secrets/$1"
}

# OMNI_LOAD_GRACE (how long a model may load: 600s, 10m) in seconds.
grace_seconds() {
    local g=${OMNI_LOAD_GRACE:-600s}
    case $g in
        *m) echo $((${g%m} * 60)) ;;
        *) echo "${g%s}" ;;
    esac
}

# The profiles: COMPOSE_PROFILES, else deploy/.env's (cpu).
profiles() {
    local p=${COMPOSE_PROFILES:-$(sed -n 's/^COMPOSE_PROFILES=//p' "$here/.env" 2>/dev/null)}
    echo "${p:-cpu}"
}

# The cluster CA and a certificate per process in $secrets/certs (the
# image's `omnictl certs`; kept when there, so a later run reuses them). The
# process keys are readable inside the containers, where compose mounts the
# files as they are (Swarm mounts its secrets for the image's user only);
# the folders' 0700 keeps other host users out. ca.key stays 0600: it never
# goes into a container, nor onto the other hosts.
make_certs() {
    local image=$1
    mkdir -p "$secrets/certs"
    docker run --rm --network none --user "$(id -u):$(id -g)" -v "$secrets/certs:/certs" "$image" \
        omnictl certs --out /certs | sed "s|/certs|$secrets/certs|; s/^/$(basename "$0"):   /"
    keys_readable
}

# The process keys in $secrets/certs readable inside the containers (also
# a folder copied from another host, whose keys came 0600).
keys_readable() {
    chmod 700 "$secrets/certs"
    find "$secrets/certs" -name '*.key' ! -name ca.key -exec chmod 644 {} +
}

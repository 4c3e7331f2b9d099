#!/usr/bin/env bash
# Build egressd's images with no container registry: CI and machines that can
# pull nothing, but reach Debian's package mirror and PyPI.
#
#   bash docker/build.sh            # build what changed; print the image names
#   bash docker/build.sh --force    # rebuild everything
#
# 1. Two local base images from Debian packages: debootstrap a bookworm root
#    filesystem and `docker import` it (needs root and debootstrap):
#      egressd-local/python:bookworm     python3 + venv: stands in for python:3.12-slim
#      egressd-local/toolchain:bookworm  python3, pip, curl, dig: the sandbox's toolchain
# 2. A wheelhouse: every Python dependency of egressd downloaded on this host
#    for the images' Python (bookworm's 3.11, manylinux x86_64).
# 3. egressd:latest (docker/Dockerfile) and egressd-sandbox:latest
#    (docker/sandbox.Dockerfile) built FROM those bases with --network none:
#    pip installs from the wheelhouse only.
#
# Cache: each image carries the label egressd.inputs=<hash of its inputs> (the
# recipe, the base image's id, the source files, the wheel names); an image
# whose label matches is not rebuilt. Root filesystems, downloaded .debs and
# wheelhouses are kept under $EGRESSD_DOCKER_CACHE (default
# /var/cache/egressd-docker), so a lost image is re-imported without a download.
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE=${EGRESSD_DOCKER_CACHE:-/var/cache/egressd-docker}
# egressd's package folders, the image's inputs (tests/project/test_imports.py
# checks this list and the Dockerfile's COPY lines against pyproject.toml).
EGRESSD_FOLDERS="names vocabulary proxy control approvals config audit sandbox agent cli fleet"
SUITE=bookworm
IMAGE_PYTHON=3.11  # bookworm's python3: the wheels must fit it
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
EGRESSD_IMAGE=${EGRESSD_IMAGE:-egressd:latest}
SANDBOX_IMAGE=${EGRESSD_SANDBOX_IMAGE:-egressd-sandbox:latest}
PYTHON_BASE=egressd-local/python:$SUITE
TOOLCHAIN_BASE=egressd-local/toolchain:$SUITE
# nftables: deploy/kubernetes/ runs this image as the pod's fence installer too (nft -f).
PYTHON_PACKAGES="python3 python3-venv ca-certificates nftables"
TOOLCHAIN_PACKAGES="python3 python3-pip ca-certificates curl dnsutils"
# What an image never needs: package lists and caches, documentation, locales,
# logs, and the build host's resolver and name (Docker provides its own).
TRIM="var/cache/apt var/lib/apt/lists usr/share/doc usr/share/man usr/share/info usr/share/locale var/log"
WHEEL_PLATFORMS="manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_28_x86_64 manylinux_2_34_x86_64"
FORCE=0
[ "${1:-}" = "--force" ] && FORCE=1

log() { echo "build.sh: $*" >&2; }
digest() { sha256sum | cut -c1-16; }
label_of() { docker image inspect -f '{{ index .Config.Labels "egressd.inputs" }}' "$1" 2>/dev/null || true; }
up_to_date() { [ "$FORCE" = 0 ] && [ "$(label_of "$1")" = "$2" ]; }

# No BuildKit without the buildx plugin: the classic builder does everything we need.
docker buildx version >/dev/null 2>&1 || export DOCKER_BUILDKIT=0
mkdir -p "$CACHE/debs"

base_image() {  # NAME "PACKAGES"
    local name=$1 packages=$2 inputs tarball dir
    inputs=$(echo "base 1 $SUITE $MIRROR [$packages] [$TRIM]" | digest)
    if up_to_date "$name" "$inputs"; then
        log "$name is up to date"
        return
    fi
    tarball=$CACHE/rootfs-$inputs.tar
    if [ ! -s "$tarball" ] || [ "$FORCE" = 1 ]; then
        if ! command -v debootstrap >/dev/null; then
            log "debootstrap is not installed (apt-get install debootstrap)"
            exit 1
        fi
        [ "$(id -u)" = 0 ] || { log "debootstrap needs root"; exit 1; }
        dir=$(mktemp -d "$CACHE/rootfs.XXXXXX")
        log "debootstrap $SUITE with $packages (log: $CACHE/debootstrap.log)"
        if ! debootstrap --variant=minbase --include="${packages// /,}" --cache-dir="$CACHE/debs" \
                "$SUITE" "$dir" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1; then
            tail -20 "$CACHE/debootstrap.log" >&2
            rm -rf "$dir"
            exit 1
        fi
        for path in $TRIM; do
            rm -rf "${dir:?}/$path"
            mkdir -p "$dir/$path"
        done
        rm -f "$dir/etc/resolv.conf" "$dir/etc/hostname"
        tar --numeric-owner -C "$dir" -cf "$tarball.tmp" .
        mv "$tarball.tmp" "$tarball"
        rm -rf "$dir"
    fi
    log "importing $name"
    docker import \
        -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        -c 'ENV LANG=C.UTF-8' \
        -c 'CMD ["/bin/sh"]' \
        -c "LABEL egressd.build=base egressd.inputs=$inputs" \
        "$tarball" "$name" >/dev/null
}

PIP=(.venv/bin/python -m pip)
[ -x .venv/bin/python ] || PIP=(python3 -m pip)

wheelhouse() {  # prints the directory
    local deps key dir
    deps=$("${PIP[0]}" - <<'EOF'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
# The images are Linux: every environment marker (uvloop's) holds there, so it is dropped
# and the requirement kept whole (a marker's spaces would split it in the shell).
wanted = project["dependencies"] + project["optional-dependencies"]["speed"] + project["optional-dependencies"]["fleet"] + ["setuptools>=68", "wheel"]
print(" ".join(sorted({req.split(";")[0].replace(" ", "") for req in wanted})))
EOF
)
    key=$(echo "wheels 1 $IMAGE_PYTHON [$WHEEL_PLATFORMS] [$deps]" | digest)
    dir=$CACHE/wheels-$key
    if [ -f "$dir/.complete" ] && [ "$FORCE" = 0 ]; then
        echo "$dir"
        return
    fi
    rm -rf "$dir"
    log "downloading wheels for Python $IMAGE_PYTHON: $deps"
    local platforms=()
    for p in $WHEEL_PLATFORMS; do platforms+=(--platform "$p"); done
    # shellcheck disable=SC2086
    "${PIP[@]}" download --quiet --disable-pip-version-check --dest "$dir" --only-binary=:all: \
        --python-version "$IMAGE_PYTHON" --implementation cp --abi "cp${IMAGE_PYTHON/./}" \
        "${platforms[@]}" $deps >&2
    touch "$dir/.complete"
    echo "$dir"
}

tree_digest() {  # a digest of the files under the given paths (names and contents)
    find "$@" -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | LC_ALL=C sort -z \
        | xargs -0 sha256sum | digest
}

build_egressd() {
    local wheels=$1 base_id inputs ctx
    base_id=$(docker image inspect -f '{{.Id}}' "$PYTHON_BASE")
    inputs=$( { echo "egressd 1 $base_id"; ls "$wheels";
                tree_digest pyproject.toml README.md $EGRESSD_FOLDERS \
                    docker/Dockerfile docker/egressd.toml docker/healthcheck.py; } | digest)
    if up_to_date "$EGRESSD_IMAGE" "$inputs"; then
        log "$EGRESSD_IMAGE is up to date"
        return
    fi
    # A context of exactly the inputs (no .venv, no .git): small and reproducible.
    ctx=$(mktemp -d "$CACHE/context.XXXXXX")
    tar --exclude=__pycache__ --exclude='*.pyc' -cf - pyproject.toml README.md \
        $EGRESSD_FOLDERS docker/Dockerfile docker/egressd.toml \
        docker/healthcheck.py | tar -xf - -C "$ctx"
    cp -r "$wheels" "$ctx/docker/wheels"
    log "building $EGRESSD_IMAGE (offline)"
    if ! docker build --network none --quiet -f "$ctx/docker/Dockerfile" \
            --build-arg BASE_IMAGE="$PYTHON_BASE" \
            --build-arg PIP_ARGS="--no-index --find-links=/src/docker/wheels" \
            --label egressd.build=egressd --label "egressd.inputs=$inputs" \
            -t "$EGRESSD_IMAGE" "$ctx" >"$CACHE/build-egressd.log" 2>&1; then
        rm -rf "$ctx"
        tail -30 "$CACHE/build-egressd.log" >&2
        log "building $EGRESSD_IMAGE failed"
        exit 1
    fi
    rm -rf "$ctx"
}

build_sandbox() {
    local base_id inputs ctx
    base_id=$(docker image inspect -f '{{.Id}}' "$TOOLCHAIN_BASE")
    inputs=$( { echo "sandbox 1 $base_id"; tree_digest docker/sandbox.Dockerfile; } | digest)
    if up_to_date "$SANDBOX_IMAGE" "$inputs"; then
        log "$SANDBOX_IMAGE is up to date"
        return
    fi
    ctx=$(mktemp -d "$CACHE/context.XXXXXX")
    cp docker/sandbox.Dockerfile "$ctx/Dockerfile"
    log "building $SANDBOX_IMAGE (offline)"
    if ! docker build --network none --quiet --build-arg BASE_IMAGE="$TOOLCHAIN_BASE" \
            --label egressd.build=sandbox --label "egressd.inputs=$inputs" \
            -t "$SANDBOX_IMAGE" "$ctx" >"$CACHE/build-sandbox.log" 2>&1; then
        rm -rf "$ctx"
        tail -30 "$CACHE/build-sandbox.log" >&2
        log "building $SANDBOX_IMAGE failed"
        exit 1
    fi
    rm -rf "$ctx"
}

started=$(date +%s)
base_image "$PYTHON_BASE" "$PYTHON_PACKAGES"
base_image "$TOOLCHAIN_BASE" "$TOOLCHAIN_PACKAGES"
WHEELS=$(wheelhouse)
build_egressd "$WHEELS"
build_sandbox
# Images replaced by a rebuild lose their tag: drop them (ours only, by label).
# Another prune already under way (a second build on this machine) is no failure.
docker image prune --force --filter label=egressd.build >/dev/null || log "could not prune old build images now; they go next time"
log "done in $(( $(date +%s) - started ))s: $EGRESSD_IMAGE $SANDBOX_IMAGE"

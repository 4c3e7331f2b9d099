# An example toolchain image for the sandbox container: a shell, Python, curl
# and dig, and the unprivileged user `agent` (uid 1000) whose home is /work, the
# working directory `egressd run --backend docker` mounts read-write.
#
#   docker build -f docker/sandbox.Dockerfile -t egressd-sandbox docker/
#
# Put your own tools here (compilers, package managers); the sandbox reaches
# package registries only through egressd, by name, as its allowlist says.
ARG BASE_IMAGE=python:3.12-slim
FROM ${BASE_IMAGE}
# The local base that docker/build.sh makes already has every package: then this
# installs nothing and the build needs no network (it runs with --network none).
RUN set -eu; missing=""; \
    for tool in curl:curl dig:dnsutils update-ca-certificates:ca-certificates; do \
        command -v "${tool%%:*}" >/dev/null || missing="$missing ${tool#*:}"; \
    done; \
    if [ -n "$missing" ]; then \
        apt-get update; \
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $missing; \
        rm -rf /var/lib/apt/lists/*; \
    fi; \
    groupadd --gid 1000 agent; \
    useradd --uid 1000 --gid 1000 --home-dir /work --no-create-home --shell /bin/sh agent; \
    install -d -o 1000 -g 1000 -m 0755 /work
ENV HOME=/work LANG=C.UTF-8
WORKDIR /work
USER 1000:1000
CMD ["sh"]

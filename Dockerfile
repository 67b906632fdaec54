# One image for every Reame process: reame-gateway, reame-worker, reame-coordinator and the reame
# CLI; the Kubernetes manifests in deploy/kubernetes choose the command. From the repository root:
#   docker build -t registry.example.com/reame:0.1.0 .
FROM debian:bookworm-slim

RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/*

# The user the manifests run as (runAsUser/fsGroup 10001) and the directories it writes: state
# (prefix store, archive, tuning tables, models), the numba kernel cache (volumes in Kubernetes)
# and /run/reame, where the shipped reame.conf puts the workers' ipc socket.
RUN groupadd --system --gid 10001 reame \
 && useradd --system --uid 10001 --gid reame --home-dir /var/lib/reame --no-create-home \
            --shell /usr/sbin/nologin reame \
 && install -d -o reame -g reame -m 750 /var/lib/reame /var/cache/reame /run/reame

# Behind a TLS-intercepting proxy: mount its CA bundle into the build and name it, e.g.
#   --volume /etc/ssl/certs/ca-certificates.crt:/etc/ssl/proxy-ca.crt:ro --build-arg PIP_CERT=/etc/ssl/proxy-ca.crt
ARG PIP_CERT
# A plain (not editable) install into its own venv; the source tree is not kept. Byte code is
# compiled here because the containers run with a read-only root file system.
COPY . /tmp/reame-src
RUN python3 -m venv /opt/reame/.venv \
 && /opt/reame/.venv/bin/pip install --no-cache-dir /tmp/reame-src \
 && install -D -m 644 /tmp/reame-src/deploy/reame.conf /etc/reame/reame.conf \
 && rm -rf /tmp/reame-src \
 && /opt/reame/.venv/bin/python -m compileall -q /opt/reame/.venv/lib

ENV PATH=/opt/reame/.venv/bin:$PATH \
    NUMBA_CACHE_DIR=/var/cache/reame/numba \
    HOME=/var/lib/reame
USER 10001:10001
EXPOSE 8000 5557
CMD ["reame-gateway", "--config", "/etc/reame/reame.conf"]

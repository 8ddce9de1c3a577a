# One image for every AISynergy process (hub, broker wrapper, edge agent); the command picks the role.
# Processes run as the unprivileged `aisynergy` user; the broker's service alone starts as root (see
# docker-compose.yml) to hand its files to the `mosquitto` user, as which Mosquitto then runs.
FROM python:3.11-slim-bookworm
RUN apt-get update && apt-get install -y --no-install-recommends mosquitto && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY interfaces ./interfaces
COPY cloud ./cloud
COPY edge ./edge
COPY device ./device
COPY conformance ./conformance
COPY firmware_images ./firmware_images
RUN pip install --no-cache-dir ".[hub,edge,device,postgres]"
# Named volumes start with the owner and mode of their mount point here.
RUN useradd --system --uid 10001 --user-group --home-dir /data --shell /usr/sbin/nologin aisynergy \
    && mkdir -p /data/pki /data/edge /data/broker /broker-pki \
    && chown aisynergy:aisynergy /data /data/pki /data/edge /broker-pki \
    && chmod 0700 /data/pki /data/edge /broker-pki
USER aisynergy
ENTRYPOINT ["aisynergy"]

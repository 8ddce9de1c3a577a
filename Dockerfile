# One image for every AISynergy process (hub, broker wrapper, edge agent); the command picks the role.
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
ENTRYPOINT ["aisynergy"]

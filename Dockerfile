# Molt Studio: `molt serve` (web app + daemon) on port 8000, data in the /data volume.
#   docker build -t molt .                                        # CPU torch (default)
#   docker build -t molt-cuda --build-arg TORCH_BUILD=cu130 .     # CUDA torch: the build torch 2.13 pairs with
#   docker run -p 8000:8000 -v molt-data:/data -e MOLT_TOKEN=... molt
#   docker run --gpus all -p 8000:8000 -v molt-data:/data molt-cuda   # the daemon schedules every GPU it sees
# Without MOLT_TOKEN a token is generated into /data/token and printed in the log with the URL to open.
# Stopping checkpoints the running worker first: give it time (docker stop -t 150; --stop-grace is 120 s).
FROM python:3.11-slim

# torch==2.13.0+cpu or +cu130 (the CUDA 13.0 build, whose libraries constraints.txt pins): the exact build, from
# the PyTorch index of that build
ARG TORCH_VERSION=2.13.0
ARG TORCH_BUILD=cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TQDM_DISABLE=1 \
    MOLT_HOME=/data

RUN useradd --create-home --uid 1000 molt \
    && mkdir /data && chown molt:molt /data

# torch first, from the index the build arg names: its own layer, reused when only the code changes
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}+${TORCH_BUILD}" \
    --index-url "https://download.pytorch.org/whl/${TORCH_BUILD}"

# the project, installed (not editable: templates and migrations ship inside it) at the versions constraints.txt
# pins; the sources go, so nothing but site-packages is imported at run time
WORKDIR /src
COPY constraints.txt pyproject.toml README.md ./
COPY molt_engine ./molt_engine
COPY molt_envs ./molt_envs
COPY daemon ./daemon
COPY app ./app
COPY templates ./templates
COPY migrations ./migrations
RUN pip install --no-cache-dir -c constraints.txt . \
    && rm -rf /src/*

WORKDIR /home/molt
USER 1000:1000
VOLUME ["/data"]
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/api/v1/health', timeout=4)"]
CMD ["molt", "serve", "--host", "0.0.0.0", "--port", "8000"]

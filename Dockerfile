# Two images from one file:
#   target "slim":   dashboard, migrations and CPU workers (CPU build of torch)
#   target "worker": GPU workers (the CUDA build of torch from PyPI)
# Both run the same `posbench` CLI as their entry point, as a non-root user.
#
# Offline, mirrored or air-gapped builds change build arguments only (docs/cluster.md):
#   BASE_IMAGE          the Python image every stage starts from
#   PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_TRUSTED_HOST   pip's own settings
#   PIP_CA_CERT         a CA bundle to trust, named by its path inside the build context
#   TORCH_CPU_INDEX     where the slim image's CPU build of torch comes from
# An empty argument means its default (docker-compose 1.29 passes every argument the
# compose file lists, set or not), so each default is written where it is used.
# No `# syntax=` line: the Dockerfile frontend built into the engine serves, so a build
# pulls nothing but BASE_IMAGE. The stages are ordered so that the classic builder
# (DOCKER_BUILDKIT=0, docker-compose 1.x), which builds every stage up to its target,
# never builds the CUDA stages for --target slim.

ARG BASE_IMAGE=""

FROM ${BASE_IMAGE:-python:3.11.11-slim} AS base
# The commit the image is built from (the build context has no .git): recorded in
# every run's provenance. docker compose build --build-arg GIT_COMMIT=$(git rev-parse HEAD)
ARG GIT_COMMIT=""
ARG PIP_CA_CERT=""
ENV POSBENCH_GIT_COMMIT=${GIT_COMMIT} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    POSBENCH_HOME=/data \
    POSBENCH_ARTIFACTS=/artifacts \
    HF_HOME=/data/huggingface
# pip trusts the system's CAs plus PIP_CA_CERT's (pyproject.toml only gives COPY a
# source when PIP_CA_CERT is empty).
COPY pyproject.toml ${PIP_CA_CERT} /tmp/build-ca/
RUN cat /etc/ssl/certs/ca-certificates.crt > /etc/pip-ca.pem \
    && if [ -n "${PIP_CA_CERT}" ]; then cat "/tmp/build-ca/${PIP_CA_CERT##*/}" >> /etc/pip-ca.pem; fi \
    && rm -rf /tmp/build-ca \
    && useradd --create-home --uid 10001 posbench \
    && mkdir -p /data /artifacts /app \
    && chown posbench:posbench /data /artifacts
ENV PIP_CERT=/etc/pip-ca.pem
WORKDIR /app

# The project's source, listed once; both images copy it from here.
FROM scratch AS source
COPY pyproject.toml README.md /src/
COPY core /src/core
COPY db /src/db
COPY jobs /src/jobs
COPY worker /src/worker
COPY cli /src/cli
COPY dashboard /src/dashboard

# Dependencies first, so that code changes do not reinstall torch. torch alone comes
# from TORCH_CPU_INDEX; its own dependencies come from pip's index with the rest.
FROM base AS deps-cpu
ARG PIP_INDEX_URL=""
ARG PIP_EXTRA_INDEX_URL=""
ARG PIP_TRUSTED_HOST=""
ARG TORCH_CPU_INDEX=""
RUN pip install --no-deps --index-url "${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}" \
    "torch>=2.4"

FROM deps-cpu AS slim
ARG PIP_INDEX_URL=""
ARG PIP_EXTRA_INDEX_URL=""
ARG PIP_TRUSTED_HOST=""
COPY --from=source /src/ ./
# [hf]: HuggingFace corpora (hf:wikitext:...) on the cpu workers, which run this image.
RUN pip install ".[hf]" && python -c "import torch, cli, db.migrate, dashboard, datasets"
USER posbench
EXPOSE 8501
ENTRYPOINT ["posbench"]
CMD ["dashboard", "--port", "8501"]

# The GPU worker: after slim, so that building slim never builds these.
FROM base AS deps-cuda
ARG PIP_INDEX_URL=""
ARG PIP_EXTRA_INDEX_URL=""
ARG PIP_TRUSTED_HOST=""
RUN pip install "torch>=2.4"

FROM deps-cuda AS worker
ARG PIP_INDEX_URL=""
ARG PIP_EXTRA_INDEX_URL=""
ARG PIP_TRUSTED_HOST=""
COPY --from=source /src/ ./
RUN pip install ".[hf]" && python -c "import cli, worker.tasks, datasets"
USER posbench
ENTRYPOINT ["posbench"]
CMD ["worker", "--queues", "gpu"]

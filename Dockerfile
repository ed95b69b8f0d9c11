# The GPU worker image of a bcdflow fleet (docs/guide/fleet.md): CUDA PyTorch, the project at /opt/bcdflow,
# and `bcdflow worker` as PID 1, so a spot box's `docker stop` (SIGTERM) lets its visit checkpoint and reschedule
# itself before the worker stops.
#
#   docker build -t bcdflow-worker .
#   docker run --gpus all \
#       -e PREFECT_API_URL=http://<prefect-host>:4200/api -e AWS_ACCESS_KEY_ID=... -e AWS_SECRET_ACCESS_KEY=... \
#       bcdflow-worker --pool bcdflow-gpu
FROM python:3.11-slim

# torch pinned like the project; from PyPI on x86-64 Linux this is the CUDA build (its CUDA libraries included)
RUN pip install --no-cache-dir torch==2.13.0

WORKDIR /opt/bcdflow
COPY pyproject.toml constraints.txt README.md ./
COPY bcdflow bcdflow
COPY core core
COPY flows flows
COPY models models
COPY storage storage
COPY tasks tasks
COPY tracking tracking
COPY prefect.yaml ./
RUN pip install --no-cache-dir -c constraints.txt -e ".[fleet,gpu]"

# where the deployments' pull step (prefect.yaml) finds the flows on this worker
ENV BCDFLOW_HOME=/opt/bcdflow \
    PREFECT_SERVER_ANALYTICS_ENABLED=false \
    DO_NOT_TRACK=1 \
    TOKENIZERS_PARALLELISM=false \
    HF_HUB_OFFLINE=1

ENTRYPOINT ["bcdflow", "worker"]
CMD ["--pool", "bcdflow-gpu"]

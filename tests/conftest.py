"""Shared test harness: telemetry off, every home/URI in a temp dir, and one session-wide Prefect
temporary server (its first database migration is slow on a fresh machine)."""
from __future__ import annotations

import logging
import os
import tempfile
import threading

_HOME = tempfile.mkdtemp(prefix="bcdflow-tests-")
os.environ.update({
    "PREFECT_HOME": os.path.join(_HOME, "prefect"),
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_LOGGING_LEVEL": "WARNING",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HOME": os.path.join(_HOME, "hf"),
    "BCDFLOW_HF_CACHE": os.path.join(_HOME, "hf-datasets"),
    "MLFLOW_TRACKING_URI": "sqlite:///" + os.path.join(_HOME, "mlflow-default.db"),
    "TOKENIZERS_PARALLELISM": "false",
    # one intra-op thread: tiny models gain nothing from two, and CLI subprocesses must match the
    # in-process reference runs thread for thread (bitwise checks)
    "OMP_NUM_THREADS": "1",
})
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "600")

import pytest  # noqa: E402
import torch  # noqa: E402

from bcdflow.core.config import RunConfig, load_config  # noqa: E402
from tests.helpers import TINY  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def prefect_server():
    """One Prefect test server for the whole session; flow tests depend on this fixture.

    Its start is bounded by wall clock: Prefect's own wait counts 0.1 s per health probe however long a probe
    blocks, so a server that accepts connections but never answers would hold the session for hours."""
    import _thread

    from prefect.testing.utilities import prefect_test_harness

    limit = float(os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"]) + 30
    started = threading.Event()
    threading.Thread(target=lambda: started.wait(limit) or _thread.interrupt_main(), daemon=True).start()
    harness = prefect_test_harness(server_startup_timeout=None)
    try:
        harness.__enter__()
    except KeyboardInterrupt:
        pytest.exit(f"the Prefect test server did not start within {limit:.0f} s", returncode=3)
    started.set()
    yield
    harness.__exit__(None, None, None)


@pytest.fixture
def tiny_cfg(tmp_path):
    """Factory: the tiny config with a store (and MLflow, off unless asked) under tmp_path."""
    def make(*sets: str, tracking: bool = False) -> RunConfig:
        extra = [f"store={tmp_path / 'store'}"]
        extra.append(f"tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}" if tracking else "tracking_uri=none")
        return load_config(sets=TINY + extra + list(sets))
    return make


@pytest.fixture(scope="session")
def prefect_api_url(prefect_server) -> str:
    """The session test server's API URL, for CLI subprocesses (no second temporary server)."""
    import prefect.settings

    return prefect.settings.PREFECT_API_URL.value()


class S3Server:
    """moto's S3 on loopback (as s3fs's and zarr's own suites test); stop/start keeps its data."""

    def __init__(self):
        from moto.server import ThreadedMotoServer

        self._cls = ThreadedMotoServer
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.server = None

    def start(self) -> None:
        self.server = self._cls(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()

    def stop(self) -> None:
        self.server.stop()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 for the session; its fake credentials are set only while it runs, then restored."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no request log on the test output
    with pytest.MonkeyPatch.context() as mp:
        for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                     "AWS_DEFAULT_REGION": "us-east-1"}.items():
            mp.setenv(k, v)
        srv = S3Server()
        srv.start()
        yield srv
        srv.stop()


@pytest.fixture
def s3_bucket(s3_server, request):
    """A fresh bucket; returns its s3:// URL."""
    import s3fs

    name = "b-" + request.node.name.lower().replace("_", "-").replace("[", "-").replace("]", "")[:40]
    fs = s3fs.S3FileSystem(endpoint_url=s3_server.endpoint)
    if not fs.exists(name):
        fs.mkdir(name)
    return f"s3://{name}"

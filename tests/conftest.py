"""Shared test harness: telemetry off, every home/URI in a temp dir (removed when the session ends; pytest keeps
``tmp_path`` folders of failed tests only: pyproject.toml), and one session-wide Prefect temporary server (its first
database migration is slow on a fresh machine)."""
from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
import threading

_HOME = tempfile.mkdtemp(prefix="bcdflow-tests-")
atexit.register(shutil.rmtree, _HOME, ignore_errors=True)  # after the test server (a session fixture) has stopped
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
    "TORCHINDUCTOR_CACHE_DIR": os.path.join(_HOME, "inductor"),  # torch makes it in /tmp on a fused AdamW step
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


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist workers (``make test``'s four) the end-to-end tests (``slow``, 10-90 s each,
    mostly waiting on processes) first, the rest after in their order: the workers take one test at a time
    (``--maxschedchunk 1``), so the long ones start at once and the short ones fill the gaps instead of a long one
    starting last and running alone. In one process the order stays the files' own."""
    if getattr(config.option, "numprocesses", None):
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)


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


class S3Proxy:
    """An HTTP proxy in front of the moto server that plays an S3-compatible store with other conditional writes:
    ``mode`` ``"pass"`` forwards every request as it is; ``"strip"`` drops ``If-None-Match`` from requests (a store
    that ignores it: a conditional PUT overwrites); ``"409"`` and ``"412"`` answer a conditional PUT of an existing
    key (moto's 412) with ``409 ConditionalRequestConflict`` or with a ``412 PreconditionFailed`` without the
    ``Condition`` element (as some S3-compatible stores reply). ``requests`` counts the requests it got, by method."""

    HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "expect", "host", "te", "upgrade"}
    ERRORS = {"409": (409, "ConditionalRequestConflict", "A conflicting conditional operation is currently in "
                                                         "progress against this resource. Please try again."),
              "412": (412, "PreconditionFailed", "At least one of the pre-conditions you specified did not hold")}

    def __init__(self, upstream: str):
        import http.client
        import http.server
        from urllib.parse import urlsplit

        self.mode = "pass"
        self.requests: dict[str, int] = {}
        proxy, up = self, urlsplit(upstream)

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _body(self) -> bytes:
                if "chunked" in self.headers.get("Transfer-Encoding", ""):
                    out = b""
                    while size := int(self.rfile.readline().split(b";")[0], 16):
                        out += self.rfile.read(size)
                        self.rfile.readline()
                    self.rfile.readline()
                    return out
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _upstream(self, method: str, headers: dict, body: bytes | None):
                conn = http.client.HTTPConnection(up.hostname, up.port, timeout=30)
                conn.request(method, self.path, body=body, headers=headers)
                r = conn.getresponse()
                data = r.read()
                conn.close()
                return r, data

            def _reply(self, status: int, headers: list, data: bytes, head: bool = False) -> None:
                self.send_response(status)
                for k, v in headers:
                    if k.lower() not in proxy.HOP and (head or k.lower() != "content-length"):
                        self.send_header(k, v)
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if not head:
                    self.wfile.write(data)

            def _any(self) -> None:
                body = self._body()
                headers = {k: v for k, v in self.headers.items() if k.lower() not in proxy.HOP}
                proxy.requests[self.command] = proxy.requests.get(self.command, 0) + 1
                conditional = next((k for k in headers if k.lower() == "if-none-match"), None)
                if conditional and self.command == "PUT" and proxy.mode == "strip":
                    del headers[conditional]
                r, data = self._upstream(self.command, headers, body if body or self.command in ("PUT", "POST")
                                         else None)
                if conditional and r.status == 412 and proxy.mode in proxy.ERRORS:  # moto's reply, reworded
                    status, code, msg = proxy.ERRORS[proxy.mode]
                    xml = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                           f"<Message>{msg}</Message><RequestId>proxy</RequestId></Error>").encode()
                    return self._reply(status, [("Content-Type", "application/xml")], xml)
                self._reply(r.status, r.getheaders(), data, head=self.command == "HEAD")

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def s3_proxy(s3_server):
    """A fresh S3Proxy in front of the session's moto server (mode ``"pass"``)."""
    proxy = S3Proxy(s3_server.endpoint)
    yield proxy
    proxy.stop()

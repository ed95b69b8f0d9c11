"""Store backends: what a store URL's protocol needs beyond what fsspec does for every protocol, one entry each.

    backend_of("s3://bucket/runs")            # BACKENDS["s3"], or None (a local path, memory://: fsspec as it is)
    backend.options(cfg.s3)                   # the config's section of that name -> fsspec storage options
    backend.defaults                          # options every store of it gets (never a cached listing on S3)
    backend.reachable(fs_options, url, root)  # one quick request: BadInput naming what is wrong (credentials, bucket)
    backend.found(error)                      # a create-if-absent that raised this found the object (S3: 409/412)

A new backend is one entry here (and, where it has settings, a section of ``core/config.RunConfig`` named as the
entry, which ``RunConfig.storage_options`` hands to ``options``; ``endpoint``: the field of it the commands'
``--endpoint-url`` sets). Nothing outside this file names a protocol's package or its errors. Every store that is not
local is checked to honour an exclusive create before a run writes (``Store.check_exclusive``, docs/DESIGN.md §9),
whatever its backend.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from fsspec.utils import get_protocol

from bcdflow.errors import BadInput


@dataclass(frozen=True)
class Backend:
    name: str
    """The backend's name: its config section's (``s3`` -> ``RunConfig.s3``)."""
    protocols: tuple[str, ...]
    options: Callable[[Any], dict]
    """The config section -> fsspec storage options."""
    example: str
    """A store URL of this backend, for messages (``s3://bucket/prefix``)."""
    defaults: dict = field(default_factory=dict)
    reachable: Callable[[dict, str, str], None] | None = None
    """``(options, url, root)``: raise BadInput unless the store answers (one request, short timeouts)."""
    found: Callable[[BaseException], bool] = lambda e: False
    """Whether a create-if-absent that raised this error found an object at its key, where the filesystem does not
    say so with FileExistsError (``Store.create``: such a create fails closed)."""
    endpoint: str | None = None
    """The field of its config section that ``--endpoint-url`` sets (an S3-compatible server), None if none."""


def _s3_options(s3) -> dict:
    """fsspec options of an ``s3://`` store (s3fs reads credentials from the AWS environment or ``s3.profile``)."""
    opts: dict = {}
    if s3.endpoint_url:
        opts["endpoint_url"] = s3.endpoint_url
    if s3.region:
        opts["client_kwargs"] = {"region_name": s3.region}
    if s3.profile:
        opts["profile"] = s3.profile
    if s3.anon:
        opts["anon"] = True
    return opts


def _s3_reachable(options: dict, url: str, root: str) -> None:
    """An S3 bucket without credentials, unreachable, missing or denied, in one line. One request with short
    timeouts and no retries (a run's own requests keep s3fs's retries for transient faults)."""
    import botocore.exceptions as bx
    from fsspec.core import url_to_fs

    quick = {**options, "skip_instance_cache": True,
             "config_kwargs": {"connect_timeout": 5, "read_timeout": 10, "retries": {"max_attempts": 1}}}
    bucket = root.split("/", 1)[0]
    endpoint = options.get("endpoint_url") or "AWS S3"
    try:
        url_to_fs(url, **quick)[0].info(bucket)
    except (bx.NoCredentialsError, bx.PartialCredentialsError):
        raise BadInput(f"store: no AWS credentials for {url} (set AWS_ACCESS_KEY_ID and "
                       "AWS_SECRET_ACCESS_KEY, or s3.profile)") from None
    except bx.ProfileNotFound as e:
        raise BadInput(f"s3.profile: {e}") from None
    except (bx.EndpointConnectionError, bx.ConnectTimeoutError, bx.ReadTimeoutError, ConnectionError) as e:
        raise BadInput(f"store: cannot reach the S3 endpoint {endpoint} for {url} ({e})") from None
    except FileNotFoundError:
        raise BadInput(f"store: bucket {bucket!r} does not exist at {endpoint} (create it first)") from None
    except PermissionError:
        raise BadInput(f"store: access to bucket {bucket!r} at {endpoint} is denied for these credentials") from None


def _s3_found(e: BaseException) -> bool:
    """s3fs raises FileExistsError for S3's 412 PreconditionFailed only when the reply names the ``If-None-Match``
    condition; an S3-compatible store that leaves the condition out gets a plain OSError (EINVAL), and a 409
    ConditionalRequestConflict (another conditional write of the key in flight: one of them wins, so this one lost) an
    OSError (EIO). Both are told by the HTTP status of the botocore error s3fs chains as the cause."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        reply = getattr(e, "response", None)
        if isinstance(reply, dict):
            status = (reply.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            code = (reply.get("Error") or {}).get("Code")
            if status in (409, 412) or code in ("PreconditionFailed", "ConditionalRequestConflict"):
                return True
        seen.add(id(e))
        e = e.__cause__
    return False


BACKENDS: dict[str, Backend] = {
    "s3": Backend("s3", ("s3", "s3a"), _s3_options, "s3://bucket/prefix",
                  # other processes write shards and markers concurrently: never trust a cached listing
                  defaults={"use_listings_cache": False}, reachable=_s3_reachable, found=_s3_found,
                  endpoint="endpoint_url"),
}


def backend_of(url: str) -> Backend | None:
    """The backend of a store URL's protocol, or None where fsspec alone serves it (a local path, ``memory://``)."""
    protocol = get_protocol(url)
    return next((b for b in BACKENDS.values() if protocol in b.protocols), None)

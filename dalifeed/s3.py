"""An S3 client for object storage (AWS S3, MinIO, ...): URLs, a boto3 client from the standard AWS
configuration, GET / PUT / HEAD / list / delete / multipart upload, and every failure as one line that
says what to do. Nothing here knows about shard folders: `shardfolder` reads them, `convert/remote` writes
them.

Every request goes through boto3 here, the loaders' too: a loader fetches each tar whole into the node's
shard cache and DALI reads the local copy.

Why boto3 for this part: it resolves endpoint, credentials and region exactly as every AWS tool does
(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, AWS_PROFILE,
AWS_REGION, ~/.aws/config and ~/.aws/credentials, instance roles), which is also what DALI's SDK reads;
its `upload_file` does multipart uploads (`TransferConfig`); and it is the maintained reference client.
Nothing here is dalifeed-specific configuration.

boto3 is imported on first use: the local paths never pay for it.
"""

from __future__ import annotations

import hashlib
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

SCHEME = "s3://"
CONNECT_TIMEOUT_S = 5  # an endpoint that does not answer fails in seconds, never hangs
READ_TIMEOUT_S = 10  # S3 answers in milliseconds; a silent endpoint costs this per attempt, plus back-off
MAX_ATTEMPTS = 3  # botocore's "standard" retries; $AWS_MAX_ATTEMPTS overrides
PART_BYTES = 8 * 2**20  # multipart above this size, in parts of this size (10,000 parts: up to 80 GiB)
PARALLEL = 16  # concurrent HEADs / small GETs
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")


class StorageError(Exception):
    """The store cannot be used: no credentials, no such bucket, access denied, unreachable. One line."""


class ObjectProblem(StorageError):
    """One object is missing, or is not what the caller expected of it (its size, its sha256)."""


@dataclass(frozen=True)
class ObjectHead:
    size: int
    sha256: str | None  # what the uploader recorded (x-amz-meta-sha256); None for objects others uploaded


def is_s3_url(location) -> bool:
    return str(location).startswith(SCHEME)


def parse_s3_url(url: str) -> tuple[str, str]:
    """"s3://bucket/some/prefix/" -> ("bucket", "some/prefix"). Raises StorageError for anything else."""
    if not is_s3_url(url):
        raise StorageError(f"{url}: not an s3:// URL")
    bucket, _, key = str(url)[len(SCHEME):].partition("/")
    if not _BUCKET.match(bucket):
        raise StorageError(f"{url}: {bucket!r} is not a valid bucket name (3-63 characters: a-z, 0-9, '.', '-')")
    return bucket, key.strip("/")


def normalize(url: str) -> str:
    bucket, key = parse_s3_url(url)
    return f"{SCHEME}{bucket}/{key}" if key else f"{SCHEME}{bucket}"


def join(url: str, name: str) -> str:
    return f"{normalize(url)}/{name}"


# ----------------------------------------------------------------------------------------------------
# the client and its errors

_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
        "AWS_PROFILE", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_MAX_ATTEMPTS", "AWS_CONFIG_FILE",
        "AWS_SHARED_CREDENTIALS_FILE")
_clients: dict = {}


def client():
    """A boto3 S3 client from the standard AWS configuration, with short timeouts and few retries (one per
    configuration seen in this process: boto3 clients are thread-safe, and making one is not free)."""
    key = tuple(os.environ.get(name) for name in _ENV)
    if key not in _clients:
        import boto3
        from botocore.config import Config

        retries = {"mode": os.environ.get("AWS_RETRY_MODE", "standard")}
        if "AWS_MAX_ATTEMPTS" not in os.environ:
            retries["max_attempts"] = MAX_ATTEMPTS
        config = Config(connect_timeout=CONNECT_TIMEOUT_S, read_timeout=READ_TIMEOUT_S, retries=retries,
                        max_pool_connections=PARALLEL + 4)
        _clients[key] = boto3.session.Session().client("s3", config=config)
    return _clients[key]


# A forked process (a DataLoader's worker; the converters' workers come from a fork server, with no client)
# makes its own client: the parent's holds pooled connections that two processes must not read from at once.
os.register_at_fork(after_in_child=_clients.clear)


def endpoint() -> str:
    return client().meta.endpoint_url


def explain(error: Exception, url: str) -> StorageError:
    """botocore's exception for a request about `url` as one line that says what to do."""
    from botocore import exceptions as bx

    if isinstance(error, (bx.NoCredentialsError, bx.PartialCredentialsError)):
        return StorageError(f"{url}: no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
                            f"AWS_PROFILE / ~/.aws/credentials")
    if isinstance(error, (bx.EndpointConnectionError, bx.ConnectTimeoutError, bx.ReadTimeoutError,
                          bx.ConnectionClosedError)):
        return StorageError(f"{url}: object store {endpoint()} unreachable ({type(error).__name__}); check "
                            f"AWS_ENDPOINT_URL and the network")
    if isinstance(error, bx.ClientError):
        code = str(error.response.get("Error", {}).get("Code", ""))
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        bucket = parse_s3_url(url)[0]
        if code == "NoSuchBucket":
            return StorageError(f"{url}: bucket {bucket!r} does not exist at {endpoint()}")
        if code in ("NoSuchKey", "404", "NotFound") or status == 404:
            return ObjectProblem(f"{url}: missing in the store")
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
                    "TokenRefreshRequired"):
            return StorageError(f"{url}: the store rejected the credentials ({code}); check AWS_ACCESS_KEY_ID, "
                                f"AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN or AWS_PROFILE")
        if code in ("AccessDenied", "403", "Forbidden", "AllAccessDisabled") or status == 403:
            return StorageError(f"{url}: access denied (the credentials in use may not read or write "
                                f"bucket {bucket!r})")
        message = error.response.get("Error", {}).get("Message", "")
        return StorageError(f"{url}: {code or status}: {message}".rstrip(": "))
    if isinstance(error, bx.BotoCoreError):
        return StorageError(f"{url}: {error}")
    return StorageError(f"{url}: {type(error).__name__}: {error}")


def _request(url: str, call, **kwargs):
    """client().<call>(Bucket=..., Key=..., **kwargs) for `url`, its failures as StorageError."""
    bucket, key = parse_s3_url(url)
    try:
        return getattr(client(), call)(Bucket=bucket, Key=key, **kwargs)
    except Exception as e:
        if _is_missing(e):  # a HEAD's 404 has no body: say whether the bucket or the object is missing
            check_bucket(url)
        raise explain(e, url) from e


def _is_missing(error: Exception) -> bool:
    from botocore.exceptions import ClientError

    return isinstance(error, ClientError) and error.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404


def check_bucket(url: str) -> None:
    """Raise StorageError unless the bucket of `url` exists and can be reached with these credentials."""
    bucket, _ = parse_s3_url(url)
    try:
        client().head_bucket(Bucket=bucket)
    except Exception as e:
        if _is_missing(e):
            raise StorageError(f"{url}: bucket {bucket!r} does not exist at {endpoint()}") from e
        raise explain(e, url) from e


# ----------------------------------------------------------------------------------------------------
# objects


def head(url: str) -> ObjectHead | None:
    """Size and recorded sha256 of an object; None if there is none (a missing bucket raises)."""
    try:
        response = _request(url, "head_object")
    except ObjectProblem:
        return None
    return ObjectHead(response["ContentLength"], response.get("Metadata", {}).get("sha256"))


def head_many(urls: list[str]) -> list[ObjectHead | None]:
    with ThreadPoolExecutor(PARALLEL) as pool:
        return list(pool.map(head, urls))


def get_bytes(url: str) -> bytes:
    """The object's bytes; ObjectProblem if it is missing."""
    return _request(url, "get_object")["Body"].read()


def read_range(url: str, offset: int, size: int) -> bytes:
    return _request(url, "get_object", Range=f"bytes={offset}-{offset + size - 1}")["Body"].read()


class ObjectStream:
    """An object's bytes streamed from one GET, as a read-only binary file (what `tarfile` reads in stream
    mode): nothing is held in memory beyond a read's buffer. ObjectProblem if the object is missing; a
    connection lost midway is a StorageError like any other request's failure."""

    def __init__(self, url: str):
        self.url = url
        self._body = _request(url, "get_object")["Body"]

    def read(self, size: int | None = -1) -> bytes:
        try:
            return self._body.read(None if size is None or size < 0 else size)
        except Exception as e:
            raise explain(e, self.url) from e

    def close(self) -> None:
        self._body.close()

    def __enter__(self) -> ObjectStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def object_sha256(url: str) -> str:
    """The sha256 of every byte of the object, streamed."""
    digest = hashlib.sha256()
    for chunk in _request(url, "get_object")["Body"].iter_chunks(2**22):
        digest.update(chunk)
    return digest.hexdigest()


def put_bytes(url: str, data: bytes) -> None:
    _request(url, "put_object", Body=data, Metadata={"sha256": hashlib.sha256(data).hexdigest()})


def upload_file(path: Path, url: str, sha256: str) -> None:
    """Upload a local file (multipart above PART_BYTES), recording its sha256 in the object's metadata so
    that a resumed conversion can tell a finished upload from a stale one with a HEAD."""
    from boto3.s3.transfer import TransferConfig

    bucket, key = parse_s3_url(url)
    config = TransferConfig(multipart_threshold=PART_BYTES, multipart_chunksize=PART_BYTES, max_concurrency=4)
    try:
        client().upload_file(str(path), bucket, key, ExtraArgs={"Metadata": {"sha256": sha256}}, Config=config)
    except Exception as e:  # boto3 wraps the ClientError in S3UploadFailedError
        cause = e.__context__ if type(e).__name__ == "S3UploadFailedError" and e.__context__ else e
        raise explain(cause, url) from e


def list_objects(url: str) -> dict[str, int]:
    """Every object under the prefix `url`: name relative to it -> size. A missing bucket raises."""
    bucket, prefix = parse_s3_url(url)
    prefix = f"{prefix}/" if prefix else ""
    found = {}
    try:
        for page in client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for entry in page.get("Contents", []):
                found[entry["Key"][len(prefix):]] = entry["Size"]
    except Exception as e:
        raise explain(e, normalize(url)) from e
    return found


def delete(url: str, names: list[str]) -> None:
    """Delete the objects `names` (relative to the prefix `url`)."""
    bucket, prefix = parse_s3_url(url)
    keys = [f"{prefix}/{name}" if prefix else name for name in names]
    for start in range(0, len(keys), 1000):
        batch = [{"Key": key} for key in keys[start:start + 1000]]
        try:
            client().delete_objects(Bucket=bucket, Delete={"Objects": batch, "Quiet": True})
        except Exception as e:
            raise explain(e, normalize(url)) from e


def abort_uploads(url: str) -> int:
    """Abort the unfinished multipart uploads under the prefix `url` (a killed upload leaves its parts,
    billed, until aborted). Returns how many."""
    bucket, prefix = parse_s3_url(url)
    aborted = 0
    try:
        for page in client().get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=f"{prefix}/"):
            for upload in page.get("Uploads", []):
                client().abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                aborted += 1
    except Exception as e:
        raise explain(e, normalize(url)) from e
    return aborted

"""A local S3-compatible server for tests and benchmarks: moto_server on loopback, in its own process.

``S3Server`` starts ``moto.server`` on a free port of 127.0.0.1, waits until it
answers, creates the bucket, and stops the process at the end. Tests and the
benchmark talk to it over HTTP through boto3, exactly as a user talks to S3.
With ``auth=True`` the server checks signatures and IAM policies: it creates
an IAM user with S3 access and hands out that user's keys, so wrong keys get a
real 403 (InvalidAccessKeyId / SignatureDoesNotMatch).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any

from .services import ServiceError, last_line, tied_to_parent
from .stopped import freeze

_S3_POLICY = '{"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}'


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the caller still retries if another process takes it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class S3Server:
    """moto_server on loopback with one bucket; a context manager.

    ``config()`` gives the S3 backend parameters that reach it; ``client()``
    a plain boto3 client for the same endpoint.
    """

    def __init__(
        self,
        bucket: str = "datamover",
        *,
        host: str = "127.0.0.1",
        region: str = "us-east-1",
        auth: bool = False,
        startup_timeout: float = 30.0,
    ) -> None:
        self.bucket = bucket
        self.host = host
        self.region = region
        self.auth = auth
        self.startup_timeout = startup_timeout
        self.port: int | None = None
        self.access_key = "testing"
        self.secret_key = "testing"
        self._proc: subprocess.Popen | None = None
        self._log: Any = None

    @property
    def endpoint_url(self) -> str:
        if self.port is None:
            raise RuntimeError("the S3 server is not running")
        return f"http://{self.host}:{self.port}"

    @staticmethod
    def available() -> tuple[bool, str]:
        """Whether moto's server and boto3 are installed here."""
        import importlib.util

        for mod, pkg in (("moto", "moto[server]"), ("flask", "moto[server]"), ("boto3", "boto3")):
            if importlib.util.find_spec(mod) is None:
                return False, f"the local S3 server needs {pkg} (pip install 'moto[server]')"
        return True, "ok"

    def start(self) -> S3Server:
        """Start the server on a free port, wait until ready, create the bucket."""
        ok, reason = self.available()
        if not ok:
            raise ServiceError(f"moto_server: {reason}")
        last: Exception | None = None
        for _ in range(3):  # a port picked free can be taken before the server binds it: an exit, another port
            try:
                self._spawn(free_port(self.host))
                break
            except ServiceError as exc:
                self.stop()
                if not exc.exited:  # it ran but never answered: another port would not help
                    raise
                last = exc
            except BaseException:
                self.stop()
                raise
        else:
            raise ServiceError(f"moto_server could not start on 3 ports: {last}")
        try:
            if self.auth:
                self._create_user()
                self._post("/moto-api/reset-auth", b"0")
            where = {"LocationConstraint": self.region}
            kw = {} if self.region == "us-east-1" else {"CreateBucketConfiguration": where}
            self.client().create_bucket(Bucket=self.bucket, **kw)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, port: int) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        self._log = tempfile.TemporaryFile()
        self._proc = subprocess.Popen(
            tied_to_parent([sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(port)]),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        self.port = port
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                why = last_line(self.log_tail())
                raise ServiceError(f"moto_server exited with {code} at start: {why}", exited=True)
            try:
                with urllib.request.urlopen(f"{self.endpoint_url}/moto-api/data.json", timeout=1) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                time.sleep(0.05)
        raise ServiceError(f"moto_server did not answer on {self.endpoint_url} within {self.startup_timeout:g} s")

    def _post(self, path: str, body: bytes) -> None:
        req = urllib.request.Request(
            f"{self.endpoint_url}{path}", data=body, method="POST", headers={"Content-Type": "text/plain"}
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            r.read()

    def _create_user(self) -> None:
        import boto3

        iam = boto3.client(
            "iam",
            endpoint_url=self.endpoint_url,
            region_name=self.region,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
        )
        iam.create_user(UserName="datamover")
        iam.put_user_policy(UserName="datamover", PolicyName="s3", PolicyDocument=_S3_POLICY)
        key = iam.create_access_key(UserName="datamover")["AccessKey"]
        self.access_key, self.secret_key = key["AccessKeyId"], key["SecretAccessKey"]

    def config(self, **overrides: Any) -> dict[str, Any]:
        """S3 backend parameters for this server (path-style addressing, its keys)."""
        return {
            "endpoint_url": self.endpoint_url,
            "region": self.region,
            "access_key_id": self.access_key,
            "secret_access_key": self.secret_key,
            "addressing_style": "path",
            **overrides,
        }

    def client(self, **config: Any) -> Any:
        """A plain boto3 S3 client for this server (``config`` goes to botocore's Config)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=self.region,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            config=Config(s3={"addressing_style": "path"}, **config),
        )

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections open, nothing answered, as a hung endpoint; returns once every
        thread of it stopped."""
        if self._proc is not None:
            freeze(self._proc.pid)

    def resume(self) -> None:
        """Thaw a paused server (SIGCONT)."""
        if self._proc is not None:
            os.kill(self._proc.pid, signal.SIGCONT)

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, nbytes: int = 4000) -> str:
        """The end of the server's output, for error messages."""
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-nbytes:]

    def stop(self) -> None:
        """Stop the server process (terminate, then kill after 5 s)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)  # a paused server cannot act on SIGTERM
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __del__(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()

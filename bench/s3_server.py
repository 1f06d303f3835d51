"""A real S3-compatible server on loopback for the tests: moto's server mode, in its own process.

Authentication is switched on after the first few requests (moto's INITIAL_NO_AUTH_ACTION_COUNT),
which create an IAM user with S3 rights and a bucket; from then on only that user's key works, so
wrong credentials are refused the way AWS refuses them.
"""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

BUCKET = "mingpt-test"
_SETUP_REQUESTS = 5  # create user, access key, policy, attach, bucket: all before auth starts


@dataclass
class S3Server:
    endpoint: str
    access_key: str
    secret_key: str
    bucket: str = BUCKET
    log_path: Optional[Path] = None
    """The server's output: a line per request it answered."""

    def requests(self, method: str, key_part: str) -> int:
        """How many `method` requests (PUT, GET, ...) for object keys containing key_part it answered."""
        pattern = re.compile(rf'"{method} /{re.escape(self.bucket)}/[^ "]*{re.escape(key_part)}')
        return len(pattern.findall(self.log_path.read_text(errors="replace")))

    def env(self, **overrides: str) -> dict:
        """The standard AWS environment a user would set to reach this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": "us-east-1",
            **overrides,
        }


class MotoExited(RuntimeError):
    """moto_server stopped before it answered: its port was taken."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until_up(endpoint: str, process: subprocess.Popen, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise MotoExited(f"moto_server exited with {process.returncode}")
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1)
            return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"moto_server did not answer at {endpoint}")


def _create_user_and_bucket(endpoint: str) -> tuple[str, str]:
    import boto3  # imported here: only the S3 tests need it

    session = boto3.session.Session(aws_access_key_id="setup", aws_secret_access_key="setup",
                                    region_name="us-east-1")
    iam = session.client("iam", endpoint_url=endpoint)
    iam.create_user(UserName="trainer")
    key = iam.create_access_key(UserName="trainer")["AccessKey"]
    policy = json.dumps({"Version": "2012-10-17",
                         "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]})
    arn = iam.create_policy(PolicyName="s3-all", PolicyDocument=policy)["Policy"]["Arn"]
    iam.attach_user_policy(UserName="trainer", PolicyArn=arn)
    session.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
    return key["AccessKeyId"], key["SecretAccessKey"]


def start_s3_server(log_path: Path, attempts: int = 3) -> tuple[S3Server, subprocess.Popen]:
    """A moto server on a free port; another port if another process took that one meanwhile."""
    for attempt in range(attempts):
        try:
            return _start_s3_server(log_path)
        except MotoExited:
            if attempt == attempts - 1:
                raise


def _start_s3_server(log_path: Path) -> tuple[S3Server, subprocess.Popen]:
    moto_server = shutil.which("moto_server", path=str(Path(sys.executable).parent))
    if moto_server is None:
        raise FileNotFoundError("moto_server is not installed (pip install -r requirements.txt)")
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT=str(_SETUP_REQUESTS))
    with open(log_path, "wb") as log:
        process = subprocess.Popen([moto_server, "-H", "127.0.0.1", "-p", str(port)],
                                   stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_until_up(endpoint, process)
        access_key, secret_key = _create_user_and_bucket(endpoint)
    except BaseException:
        process.kill()
        raise
    return S3Server(endpoint, access_key, secret_key, log_path=log_path), process

"""boto3 sessions and clients from the environment, and AWS errors turned into one-line InfraErrors.

Credentials come from wherever boto3 looks (``AWS_PROFILE``, ``AWS_ACCESS_KEY_ID``/…, SSO, an
instance role); nothing here reads or stores them. The region is explicit or from the environment,
never guessed: trn2 exists in few regions and a silent default would look for it in the wrong one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

# AWS error codes that mean the caller asked for something that cannot exist or is malformed.
_BAD_INPUT_CODES = {
    "ValidationException", "ValidationError", "InvalidParameterValue", "InvalidParameterException",
    "InvalidParameterCombination", "InvalidRequestException", "ResourceNotFoundException", "ParameterNotFound",
    "InvalidBucketName", "NoSuchBucket", "InvalidGroup.NotFound", "InvalidVpcID.NotFound",
    "InvalidAMIID.Malformed", "NoSuchEntity", "InvalidInstanceType",
}


class InfraError(Exception):
    """A failure with a one-line message; ``code`` is the exit status the CLI returns."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(" ".join(str(message).split()))
        self.code = code


class BadInput(InfraError):
    """The caller's input (a name, a flag, a spec, a secret's shape) is wrong: exit 2."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code=2)


def region(explicit: str | None = None) -> str:
    """The region to use: ``--region``, else ``AWS_REGION``/``AWS_DEFAULT_REGION``, else the profile's."""
    name = explicit or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if not name:
        import boto3

        name = boto3.session.Session().region_name
    if not name:
        raise BadInput("no AWS region: pass --region or set AWS_REGION (trn2 regions: see docs/aws.md)")
    return name


def client(service: str, region_name: str) -> Any:
    """A boto3 client with bounded timeouts and AWS's standard retry mode (throttling is retried)."""
    import boto3
    from botocore.config import Config

    config = Config(retries={"mode": "standard", "max_attempts": 5}, connect_timeout=10, read_timeout=60)
    return boto3.session.Session(region_name=region_name).client(service, config=config)


def error_code(exc: BaseException) -> str:
    """The AWS error code of a botocore ClientError ('' for anything else)."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


def http_status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return None


def translate(exc: BaseException, what: str) -> InfraError:
    """One InfraError for any botocore failure, naming what was being done."""
    from botocore import exceptions as bex

    if isinstance(exc, InfraError):
        return exc
    if isinstance(exc, bex.NoCredentialsError | bex.PartialCredentialsError):
        return InfraError(f"{what}: no AWS credentials (set AWS_PROFILE or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                          "or run where an instance role is attached)")
    if isinstance(exc, bex.NoRegionError):
        return BadInput(f"{what}: no AWS region: pass --region or set AWS_REGION")
    if isinstance(exc, bex.EndpointConnectionError | bex.ConnectTimeoutError | bex.ReadTimeoutError):
        return InfraError(f"{what}: cannot reach AWS ({exc})")
    if isinstance(exc, bex.ClientError):
        code = error_code(exc)
        message = exc.response.get("Error", {}).get("Message") or code  # type: ignore[attr-defined]
        if code in ("AccessDenied", "AccessDeniedException", "UnauthorizedOperation"):
            return InfraError(f"{what}: access denied ({message})")
        return InfraError(f"{what}: {code}: {message}", code=2 if code in _BAD_INPUT_CODES else 1)
    if isinstance(exc, bex.BotoCoreError):
        return InfraError(f"{what}: {exc}")
    return InfraError(f"{what}: {type(exc).__name__}: {exc}")


def call(what: str, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """Run one AWS call; any botocore failure becomes an InfraError that names ``what``."""
    from botocore import exceptions as bex

    try:
        return fn(*args, **kwargs)
    except (bex.BotoCoreError, bex.ClientError) as e:
        raise translate(e, what) from None


def account_id(region_name: str) -> str:
    """The caller's account, from STS (also the cheapest check that credentials work)."""
    sts = client("sts", region_name)
    return str(call("STS GetCallerIdentity", sts.get_caller_identity)["Account"])

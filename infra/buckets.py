"""The S3 bucket for trial artifacts and the Neuron compile cache: create or find it, and delete it.

One bucket per account and region (``trnsweep-<account>-<region>`` unless named): the sweep's artifact
store under ``artifacts/``, trials' working files under ``trial-files/``, compiled NEFFs under
``neuron-cache/``. Creating is idempotent and always leaves the bucket private (all four public-access
blocks on, ACLs disabled) and encrypted at rest (SSE-S3, or SSE-KMS with a given key): trial logs carry
configs and paths that are nobody else's business.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from infra.aws import BadInput, InfraError, call, error_code, http_status, translate

ARTIFACTS_PREFIX = "artifacts"
CACHE_PREFIX = "neuron-cache"
_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_PUBLIC_BLOCK = {"BlockPublicAcls": True, "IgnorePublicAcls": True, "BlockPublicPolicy": True,
                 "RestrictPublicBuckets": True}


@dataclass(frozen=True)
class Bucket:
    name: str
    region: str
    created: bool

    @property
    def artifacts_url(self) -> str:
        return f"s3://{self.name}/{ARTIFACTS_PREFIX}"

    @property
    def cache_url(self) -> str:
        return f"s3://{self.name}/{CACHE_PREFIX}"


def default_name(account: str, region_name: str) -> str:
    """A name unlikely to be taken: bucket names are global across all AWS accounts."""
    return f"trnsweep-{account}-{region_name}"


def check_name(name: str) -> str:
    """S3's naming rules, checked before any call so a typo is exit 2, not an AWS error."""
    if not _NAME.fullmatch(name) or ".." in name or re.fullmatch(r"\d+\.\d+\.\d+\.\d+", name):
        raise BadInput(f"bucket name {name!r}: 3-63 characters of a-z, 0-9, '.' and '-', starting and ending "
                       "with a letter or digit")
    return name


def bucket_region(s3: Any, name: str) -> str:
    """Where an existing bucket lives (S3 reports us-east-1 as None and eu-west-1 as 'EU')."""
    location = call(f"bucket {name}: GetBucketLocation", s3.get_bucket_location, Bucket=name).get("LocationConstraint")
    return {None: "us-east-1", "": "us-east-1", "EU": "eu-west-1"}.get(location, location)


def exists(s3: Any, name: str) -> bool:
    """True if the bucket exists and is ours; an error naming the cause if it belongs to someone else."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        s3.head_bucket(Bucket=name)
        return True
    except ClientError as e:
        status, code = http_status(e), error_code(e)
        if status == 404 or code in ("404", "NoSuchBucket", "NotFound"):
            return False
        if status == 403 or code in ("403", "Forbidden", "AccessDenied"):
            raise InfraError(f"bucket {name} exists but is not accessible to this account "
                             "(someone else's name, or missing s3:ListBucket): choose another --name") from None
        raise translate(e, f"bucket {name}") from None
    except BotoCoreError as e:
        raise translate(e, f"bucket {name}") from None


def ensure(s3: Any, name: str, region_name: str, kms_key_id: str | None = None) -> Bucket:
    """Create the bucket if missing, then enforce privacy and encryption; safe to run any number of times."""
    from botocore.exceptions import ClientError

    check_name(name)
    created = False
    if exists(s3, name):
        where = bucket_region(s3, name)
        if where != region_name:
            raise BadInput(f"bucket {name} is in {where}, not {region_name}: use --region {where} or another --name")
    else:
        kwargs: dict[str, Any] = {"Bucket": name}
        if region_name != "us-east-1":  # S3 rejects a LocationConstraint of us-east-1
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region_name}
        try:
            s3.create_bucket(**kwargs)
            created = True
        except ClientError as e:
            code = error_code(e)
            if code == "BucketAlreadyExists":
                raise InfraError(f"bucket name {name} is taken by another account: choose another --name") from None
            if code != "BucketAlreadyOwnedByYou":  # a concurrent create by us is fine
                raise translate(e, f"create bucket {name}") from None
        call(f"bucket {name}: wait until it exists", s3.get_waiter("bucket_exists").wait, Bucket=name,
             WaiterConfig={"Delay": 2, "MaxAttempts": 30})
    _secure(s3, name, kms_key_id)
    if created:
        # Multipart uploads of big checkpoints that die half-way would otherwise be billed forever.
        call(f"bucket {name}: lifecycle", s3.put_bucket_lifecycle_configuration, Bucket=name,
             LifecycleConfiguration={"Rules": [{
                 "ID": "abort-incomplete-uploads", "Status": "Enabled", "Filter": {"Prefix": ""},
                 "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 7}}]})
        call(f"bucket {name}: tags", s3.put_bucket_tagging, Bucket=name,
             Tagging={"TagSet": [{"Key": "project", "Value": "trnsweep"}]})
    return Bucket(name=name, region=region_name, created=created)


def _secure(s3: Any, name: str, kms_key_id: str | None) -> None:
    call(f"bucket {name}: block public access", s3.put_public_access_block, Bucket=name,
         PublicAccessBlockConfiguration=_PUBLIC_BLOCK)
    call(f"bucket {name}: disable ACLs", s3.put_bucket_ownership_controls, Bucket=name,
         OwnershipControls={"Rules": [{"ObjectOwnership": "BucketOwnerEnforced"}]})
    rule: dict[str, Any] = {"ApplyServerSideEncryptionByDefault": {"SSEAlgorithm": "AES256"}}
    if kms_key_id:
        rule = {"ApplyServerSideEncryptionByDefault": {"SSEAlgorithm": "aws:kms", "KMSMasterKeyID": kms_key_id},
                "BucketKeyEnabled": True}
    call(f"bucket {name}: default encryption", s3.put_bucket_encryption, Bucket=name,
         ServerSideEncryptionConfiguration={"Rules": [rule]})


def describe(s3: Any, name: str) -> dict[str, Any]:
    """The settings ``ensure`` enforces, read back (for ``infra check`` and the tests)."""
    pab = call(f"bucket {name}", s3.get_public_access_block, Bucket=name)["PublicAccessBlockConfiguration"]
    enc = call(f"bucket {name}", s3.get_bucket_encryption, Bucket=name)["ServerSideEncryptionConfiguration"]
    algorithm = enc["Rules"][0]["ApplyServerSideEncryptionByDefault"]["SSEAlgorithm"]
    return {"name": name, "region": bucket_region(s3, name), "public_access_blocked": all(pab.values()),
            "encryption": algorithm}


def delete(s3: Any, name: str) -> int:
    """Delete every object version and the bucket itself; returns the number of objects removed."""
    check_name(name)
    if not exists(s3, name):
        raise BadInput(f"bucket {name} does not exist")
    removed = 0
    paginator = s3.get_paginator("list_object_versions")
    for page in call(f"bucket {name}: list objects", lambda: list(paginator.paginate(Bucket=name))):
        keys = [{"Key": v["Key"], "VersionId": v["VersionId"]}
                for v in page.get("Versions", []) + page.get("DeleteMarkers", [])]
        for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = keys[i:i + 1000]
            out = call(f"bucket {name}: delete objects", s3.delete_objects, Bucket=name,
                       Delete={"Objects": batch, "Quiet": True})
            if out.get("Errors"):
                first = out["Errors"][0]
                raise InfraError(f"bucket {name}: could not delete {first.get('Key')}: {first.get('Message')}")
            removed += len(batch)
    call(f"delete bucket {name}", s3.delete_bucket, Bucket=name)
    return removed

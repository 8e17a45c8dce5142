"""Instance roles for the cluster: what the head and the trn2 workers may do, and nothing more.

- ``trnsweep-head``: run the Ray autoscaler, read and write the bucket, read the database secret. Of EC2
  it gets what Ray's AWS node provider calls (ray/autoscaler/_private/aws/node_provider.py): the read-only
  ``Describe*``, ``RunInstances`` of instances tagged ``project=trnsweep`` as they are created (every node
  config of infra/ray/trn2.yaml tags so), ``CreateTags`` at creation or of Ray's own tags on such an
  instance, and ``Start``/``Stop``/``TerminateInstances`` of instances carrying the tag; plus passing the
  worker role to the instances it starts. Not Ray's default (``AmazonEC2FullAccess``, which an older
  ``infra iam`` attached and ``ensure`` now detaches): that lets whoever runs code on the head stop any
  instance of the account.
- ``trnsweep-worker``: read and write the bucket (compile cache, artifacts). No EC2, no secrets: the
  database URL reaches a trial inside its Ray task, never through the worker's own credentials.

Each role has an instance profile of the same name, which the cluster config names. Creating is
idempotent (policies are rewritten to the current bucket and secret); ``delete`` undoes it.
"""

from __future__ import annotations

import json
from typing import Any

from infra.aws import BadInput, call, error_code, translate

HEAD = "trnsweep-head"
WORKER = "trnsweep-worker"
_EC2_MANAGED = "arn:aws:iam::aws:policy/AmazonEC2FullAccess"  # Ray's default head role's: detached, not used
TAG_KEY, TAG_VALUE = "project", "trnsweep"  # on every node (infra/ray/trn2.yaml) and role we make
# What RunInstances touches besides the instance; only the instance carries our tag at creation.
_RUN_WITH = ("arn:aws:ec2:*::image/*", *(f"arn:aws:ec2:*:*:{kind}/*" for kind in (
    "subnet", "security-group", "network-interface", "volume", "key-pair", "spot-instances-request",
    "placement-group", "capacity-reservation", "launch-template")))
_INSTANCES = "arn:aws:ec2:*:*:instance/*"
_TRUST = {"Version": "2012-10-17", "Statement": [
    {"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"}, "Action": "sts:AssumeRole"}]}


def bucket_statement(bucket: str) -> list[dict[str, Any]]:
    return [
        {"Effect": "Allow", "Action": ["s3:ListBucket", "s3:GetBucketLocation"], "Resource": f"arn:aws:s3:::{bucket}"},
        {"Effect": "Allow", "Action": ["s3:GetObject", "s3:PutObject", "s3:AbortMultipartUpload"],
         "Resource": f"arn:aws:s3:::{bucket}/*"},
    ]


def autoscaler_statements() -> list[dict[str, Any]]:
    """EC2 for Ray's autoscaler, every mutating action bound to instances tagged ``project=trnsweep``."""
    tagged = {"StringEquals": {f"aws:ResourceTag/{TAG_KEY}": TAG_VALUE}}
    return [
        {"Effect": "Allow", "Action": "ec2:Describe*", "Resource": "*"},  # Describe has no resource level
        {"Effect": "Allow", "Action": "ec2:RunInstances", "Resource": _INSTANCES,
         "Condition": {"StringEquals": {f"aws:RequestTag/{TAG_KEY}": TAG_VALUE}}},
        {"Effect": "Allow", "Action": "ec2:RunInstances", "Resource": list(_RUN_WITH)},
        {"Effect": "Allow", "Action": "ec2:CreateTags", "Resource": _INSTANCES,
         "Condition": {"StringEquals": {"ec2:CreateAction": "RunInstances"}}},
        {"Effect": "Allow", "Action": "ec2:CreateTags", "Resource": _INSTANCES,  # Ray's node-status tags
         "Condition": {**tagged, "ForAllValues:StringLike": {"aws:TagKeys": ["ray-*", "Name"]}}},
        {"Effect": "Allow", "Action": ["ec2:TerminateInstances", "ec2:StopInstances", "ec2:StartInstances"],
         "Resource": _INSTANCES, "Condition": tagged},
    ]


def head_policy(bucket: str, worker_role_arn: str, secret_arn: str | None) -> dict[str, Any]:
    statements = bucket_statement(bucket) + autoscaler_statements() + [
        {"Effect": "Allow", "Action": "iam:PassRole", "Resource": worker_role_arn},
    ]
    if secret_arn:
        statements.append({"Effect": "Allow", "Action": ["secretsmanager:GetSecretValue",
                                                         "secretsmanager:DescribeSecret"], "Resource": secret_arn})
    return {"Version": "2012-10-17", "Statement": statements}


def worker_policy(bucket: str) -> dict[str, Any]:
    return {"Version": "2012-10-17", "Statement": bucket_statement(bucket)}


def secret_arn(sm: Any, secret_id: str) -> str:
    """The full ARN of a secret (its name alone does not match IAM resources: ARNs carry a suffix)."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return str(sm.describe_secret(SecretId=secret_id)["ARN"])
    except ClientError as e:
        if error_code(e) == "ResourceNotFoundException":
            raise BadInput(f"secret {secret_id}: not found in {sm.meta.region_name}; create it first") from None
        raise translate(e, f"secret {secret_id}") from None
    except BotoCoreError as e:
        raise translate(e, f"secret {secret_id}") from None


def _ensure_role(iam: Any, name: str, policy: dict[str, Any], managed: tuple[str, ...] = ()) -> str:
    from botocore.exceptions import ClientError

    try:
        arn = iam.get_role(RoleName=name)["Role"]["Arn"]
    except ClientError as e:
        if error_code(e) != "NoSuchEntity":
            raise translate(e, f"IAM role {name}") from None
        arn = call(f"create IAM role {name}", iam.create_role, RoleName=name,
                   AssumeRolePolicyDocument=json.dumps(_TRUST), Description="trnsweep Ray cluster node",
                   Tags=[{"Key": "project", "Value": "trnsweep"}])["Role"]["Arn"]
    call(f"IAM role {name}: policy", iam.put_role_policy, RoleName=name, PolicyName=name,
         PolicyDocument=json.dumps(policy))
    for policy_arn in managed:
        call(f"IAM role {name}: attach {policy_arn}", iam.attach_role_policy, RoleName=name, PolicyArn=policy_arn)
    for attached in call(f"IAM role {name}", iam.list_attached_role_policies, RoleName=name)["AttachedPolicies"]:
        if attached["PolicyArn"] not in managed:  # e.g. the EC2 full access an older version attached
            call(f"IAM role {name}: detach {attached['PolicyArn']}", iam.detach_role_policy, RoleName=name,
                 PolicyArn=attached["PolicyArn"])
    try:
        iam.get_instance_profile(InstanceProfileName=name)
    except ClientError as e:
        if error_code(e) != "NoSuchEntity":
            raise translate(e, f"instance profile {name}") from None
        call(f"create instance profile {name}", iam.create_instance_profile, InstanceProfileName=name)
    roles = call(f"instance profile {name}", iam.get_instance_profile,
                 InstanceProfileName=name)["InstanceProfile"]["Roles"]
    if name not in {r["RoleName"] for r in roles}:
        call(f"instance profile {name}: add role", iam.add_role_to_instance_profile, InstanceProfileName=name,
             RoleName=name)
    return str(arn)


def ensure(iam: Any, bucket: str, secret: str | None = None) -> dict[str, str]:
    """Create or update both roles and profiles; ``secret`` is the database secret's ARN (or None)."""
    worker_arn = _ensure_role(iam, WORKER, worker_policy(bucket))
    head_arn = _ensure_role(iam, HEAD, head_policy(bucket, worker_arn, secret))
    for name in (HEAD, WORKER):  # EC2 rejects a profile for a few seconds after it is created
        call(f"instance profile {name}: wait", iam.get_waiter("instance_profile_exists").wait,
             InstanceProfileName=name, WaiterConfig={"Delay": 2, "MaxAttempts": 15})
    return {"head_role": head_arn, "worker_role": worker_arn, "head_profile": HEAD, "worker_profile": WORKER}


def delete(iam: Any) -> list[str]:
    """Remove both profiles and roles (whatever of them exists); returns what was deleted."""
    from botocore.exceptions import ClientError

    deleted: list[str] = []
    for name in (HEAD, WORKER):
        try:
            roles = iam.get_instance_profile(InstanceProfileName=name)["InstanceProfile"]["Roles"]
            for role in roles:
                call(f"instance profile {name}", iam.remove_role_from_instance_profile, InstanceProfileName=name,
                     RoleName=role["RoleName"])
            call(f"delete instance profile {name}", iam.delete_instance_profile, InstanceProfileName=name)
            deleted.append(f"instance-profile/{name}")
        except ClientError as e:
            if error_code(e) != "NoSuchEntity":
                raise translate(e, f"instance profile {name}") from None
        try:
            iam.get_role(RoleName=name)
        except ClientError as e:
            if error_code(e) == "NoSuchEntity":
                continue
            raise translate(e, f"IAM role {name}") from None
        for policy in call(f"IAM role {name}", iam.list_role_policies, RoleName=name)["PolicyNames"]:
            call(f"IAM role {name}", iam.delete_role_policy, RoleName=name, PolicyName=policy)
        for attached in call(f"IAM role {name}", iam.list_attached_role_policies, RoleName=name)["AttachedPolicies"]:
            call(f"IAM role {name}", iam.detach_role_policy, RoleName=name, PolicyArn=attached["PolicyArn"])
        call(f"delete IAM role {name}", iam.delete_role, RoleName=name)
        deleted.append(f"role/{name}")
    return deleted

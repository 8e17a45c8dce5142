"""Hardening of what infra renders (docs/security.md): cluster.env's values stay literal when a shell sources
it, and the head's instance role reaches only the project's tagged instances (moto stands in for IAM)."""

from __future__ import annotations

import json
import subprocess

import boto3

from infra import cluster, iam
from tests.infra.test_aws import REGION, aws  # noqa: F401 - the fixture
from tests.infra.test_cluster import options

NASTY = "trnsweep/db it's \"quoted\" $(touch {m}/dollar) `touch {m}/tick` ${{HOME}} \\ end"


def test_cluster_env_values_stay_literal_when_sourced(tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    secret = NASTY.format(m=marks)
    env = cluster.env_file(options(tmp_path, db="secret", db_secret=secret, bucket="b $(touch x)"))
    path = tmp_path / "cluster.env"
    path.write_text(env)
    out = subprocess.run(["sh", "-c", f'. "{path}" && printf "%s\\n%s" "$SWEEP_DB_SECRET" "$TRNSWEEP_S3"'],
                         capture_output=True, text=True, check=True, cwd=tmp_path,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}).stdout
    assert out.split("\n") == [secret, "s3://b $(touch x)"]
    assert list(marks.iterdir()) == [] and not (tmp_path / "x").exists()


def test_the_default_secret_still_expands_home(tmp_path):
    path = tmp_path / "cluster.env"
    path.write_text(cluster.env_file(options(tmp_path)))
    out = subprocess.run(["sh", "-c", f'. "{path}" && printf %s "$SWEEP_DB_SECRET"'], capture_output=True,
                         text=True, check=True, env={"PATH": "/usr/bin:/bin", "HOME": "/home/u"}).stdout
    assert out == "file:/home/u/.trnsweep/db.json"


def _actions(statement: dict) -> list[str]:
    a = statement["Action"]
    return [a] if isinstance(a, str) else list(a)


def _resources(statement: dict) -> list[str]:
    r = statement["Resource"]
    return [r] if isinstance(r, str) else list(r)


def test_the_head_policy_grants_no_ec2_wildcard_and_binds_mutations_to_the_tag():
    policy = iam.head_policy("bkt", "arn:aws:iam::1:role/trnsweep-worker", None)
    tag = f"aws:ResourceTag/{iam.TAG_KEY}"
    for s in policy["Statement"]:
        acts = _actions(s)
        assert not any(a in ("*", "ec2:*") or a.startswith("ec2:*") for a in acts), s
        ec2_writes = [a for a in acts if a.startswith("ec2:") and not a.startswith("ec2:Describe")]
        if not ec2_writes:
            continue
        assert "*" not in _resources(s), s
        cond = s.get("Condition", {})
        if any(r.endswith(":instance/*") for r in _resources(s)):  # every write on an instance is conditioned
            assert cond, s
        if set(ec2_writes) & {"ec2:TerminateInstances", "ec2:StopInstances", "ec2:StartInstances"}:
            assert cond["StringEquals"][tag] == iam.TAG_VALUE, s
    runs = [s for s in policy["Statement"] if "ec2:RunInstances" in _actions(s)
            and any(r.endswith(":instance/*") for r in _resources(s))]
    assert runs and all(s["Condition"]["StringEquals"][f"aws:RequestTag/{iam.TAG_KEY}"] == iam.TAG_VALUE
                        for s in runs)
    # The nodes the autoscaler starts carry the tag the policy asks for.
    tmpl = cluster.TEMPLATE.read_text()
    assert tmpl.count(f"Tags: [{{Key: {iam.TAG_KEY}, Value: {iam.TAG_VALUE}}}]") == 3


def test_ensure_detaches_ec2_full_access_from_an_older_head_role(aws, monkeypatch):  # noqa: F811
    monkeypatch.setenv("MOTO_IAM_LOAD_MANAGED_POLICIES", "true")  # AmazonEC2FullAccess must exist (slow)
    client = boto3.client("iam", region_name=REGION)
    client.create_role(RoleName=iam.HEAD, AssumeRolePolicyDocument=json.dumps(iam._TRUST))
    client.attach_role_policy(RoleName=iam.HEAD, PolicyArn=iam._EC2_MANAGED)  # what the older version did
    iam.ensure(client, "bkt")
    assert client.list_attached_role_policies(RoleName=iam.HEAD)["AttachedPolicies"] == []
    doc = client.get_role_policy(RoleName=iam.HEAD, PolicyName=iam.HEAD)["PolicyDocument"]
    assert "ec2:TerminateInstances" in json.dumps(doc) and '"ec2:*"' not in json.dumps(doc)

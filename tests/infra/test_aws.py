"""infra's boto3 helpers against moto (S3, Secrets Manager, SSM, IAM, EC2) and botocore's Stubber.

No test reaches AWS: moto intercepts every call inside ``mock_aws``, and the credentials are fake.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import boto3
import moto
import pytest
from botocore.stub import Stubber

from infra import ami, buckets, iam, network, secrets, sync  # noqa: E402
from infra.aws import BadInput, InfraError, call, translate  # noqa: E402
from tests.infra.dlami import image as dlami  # noqa: E402
from tests.infra.dlami import publish  # noqa: E402

REGION = "us-east-2"
PASSWORD = "s3cr/t:p@ss%w0rd"


@pytest.fixture
def aws(monkeypatch):
    """Fake credentials, a fixed region, no profile or real config; moto for everything inside."""
    for var in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "SWEEP_STORAGE", "SWEEP_DB_SECRET", "SWEEP_DB_HOST",
                "SWEEP_DB_NAME"):
        monkeypatch.delenv(var, raising=False)
    for var, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                       ("AWS_SESSION_TOKEN", "testing"), ("AWS_REGION", REGION), ("AWS_DEFAULT_REGION", REGION),
                       ("AWS_CONFIG_FILE", os.devnull), ("AWS_SHARED_CREDENTIALS_FILE", os.devnull)):
        monkeypatch.setenv(var, value)
    with moto.mock_aws():
        yield


def s3(region: str = REGION):
    return boto3.client("s3", region_name=region)


# -- buckets --------------------------------------------------------------------------------------

def test_bucket_created_private_encrypted_and_idempotent(aws):
    first = buckets.ensure(s3(), "trnsweep-test-bucket", REGION)
    assert first.created and first.region == REGION
    assert first.artifacts_url == "s3://trnsweep-test-bucket/artifacts"
    assert first.cache_url == "s3://trnsweep-test-bucket/neuron-cache"
    info = buckets.describe(s3(), "trnsweep-test-bucket")
    assert info == {"name": "trnsweep-test-bucket", "region": REGION, "public_access_blocked": True,
                    "encryption": "AES256"}
    rules = s3().get_bucket_lifecycle_configuration(Bucket="trnsweep-test-bucket")["Rules"]
    assert rules[0]["AbortIncompleteMultipartUpload"]["DaysAfterInitiation"] == 7
    again = buckets.ensure(s3(), "trnsweep-test-bucket", REGION)
    assert not again.created


def test_bucket_in_us_east_1_has_no_location_constraint(aws):
    b = buckets.ensure(s3("us-east-1"), "trnsweep-east-1", "us-east-1")
    assert b.created and buckets.bucket_region(s3("us-east-1"), "trnsweep-east-1") == "us-east-1"


def test_existing_bucket_gets_secured_and_kms(aws):
    s3().create_bucket(Bucket="preexisting", CreateBucketConfiguration={"LocationConstraint": REGION})
    b = buckets.ensure(s3(), "preexisting", REGION, kms_key_id="alias/trnsweep")
    assert not b.created
    info = buckets.describe(s3(), "preexisting")
    assert info["public_access_blocked"] and info["encryption"] == "aws:kms"


def test_bucket_in_another_region_is_bad_input(aws):
    buckets.ensure(s3("us-west-2"), "west-bucket", "us-west-2")
    with pytest.raises(BadInput, match="is in us-west-2, not us-east-2"):
        buckets.ensure(s3(), "west-bucket", REGION)


@pytest.mark.parametrize("name", ["UPPER", "ab", "a" * 64, "-lead", "trail-", "x..y", "192.168.0.1", "under_score"])
def test_bad_bucket_names_rejected_before_any_call(name):
    with pytest.raises(BadInput, match="bucket name"):
        buckets.check_name(name)


def test_bucket_owned_by_someone_else():
    client = boto3.client("s3", region_name=REGION, aws_access_key_id="x", aws_secret_access_key="x")
    with Stubber(client) as stub:
        stub.add_client_error("head_bucket", service_error_code="403", http_status_code=403)
        with pytest.raises(InfraError, match="not accessible to this account") as e:
            buckets.ensure(client, "taken-name", REGION)
    assert e.value.code == 1
    with Stubber(client) as stub:
        stub.add_client_error("head_bucket", service_error_code="404", http_status_code=404)
        stub.add_client_error("create_bucket", service_error_code="BucketAlreadyExists", http_status_code=409)
        with pytest.raises(InfraError, match="taken by another account"):
            buckets.ensure(client, "taken-name", REGION)


def test_bucket_delete_removes_versions_and_bucket(aws):
    buckets.ensure(s3(), "doomed", REGION)
    s3().put_bucket_versioning(Bucket="doomed", VersioningConfiguration={"Status": "Enabled"})
    for i in range(3):
        s3().put_object(Bucket="doomed", Key="artifacts/a.txt", Body=f"v{i}".encode())
    s3().put_object(Bucket="doomed", Key="neuron-cache/x.neff", Body=b"neff")
    assert buckets.delete(s3(), "doomed") == 4
    assert not buckets.exists(s3(), "doomed")
    with pytest.raises(BadInput, match="does not exist"):
        buckets.delete(s3(), "doomed")


# -- database URL from secrets --------------------------------------------------------------------

def sm():
    return boto3.client("secretsmanager", region_name=REGION)


def rds_json(**over) -> str:
    data = {"engine": "postgres", "username": "optuna", "password": PASSWORD, "host": "db.example.internal",
            "port": 5432, "dbname": "studies"}
    data.update(over)
    return json.dumps({k: v for k, v in data.items() if v is not None})


def test_secret_rds_json_becomes_quoted_url(aws):
    sm().create_secret(Name="trnsweep/db", SecretString=rds_json())
    got = secrets.resolve(env={}, secret_id="trnsweep/db", region_name=REGION)
    assert got.url == "postgresql+psycopg2://optuna:s3cr%2Ft%3Ap%40ss%25w0rd@db.example.internal:5432/studies"
    assert got.source == "secret trnsweep/db"
    assert PASSWORD not in secrets.redact(got.url) and "s3cr" not in secrets.redact(got.url)
    assert secrets.redact(got.url) == "postgresql+psycopg2://optuna:***@db.example.internal:5432/studies"


def test_secret_holding_a_url_and_binary_and_env_precedence(aws):
    url = "postgresql+psycopg2://optuna:pw@h:5432/db"
    sm().create_secret(Name="as-url", SecretString=url)
    sm().create_secret(Name="as-binary", SecretBinary=rds_json().encode())
    assert secrets.resolve(env={"SWEEP_DB_SECRET": "as-url"}).url == url
    assert secrets.resolve(env={}, secret_id="as-binary").url.startswith("postgresql+psycopg2://optuna:")
    # SWEEP_STORAGE wins over SWEEP_DB_SECRET; an explicit --secret-id wins over both.
    env = {"SWEEP_STORAGE": "postgresql://a:b@c/d", "SWEEP_DB_SECRET": "as-url"}
    assert secrets.resolve(env=env).source == "SWEEP_STORAGE"
    assert secrets.resolve(env=env, secret_id="as-url").url == url
    assert secrets.resolve(env={}) is None


def test_rds_managed_secret_takes_host_from_environment(aws):
    sm().create_secret(Name="rds!db-123", SecretString=json.dumps({"username": "optuna", "password": PASSWORD}))
    with pytest.raises(BadInput, match="missing host .*SWEEP_DB_HOST") as e:
        secrets.resolve(env={}, secret_id="rds!db-123")
    assert PASSWORD not in str(e.value)
    got = secrets.resolve(env={"SWEEP_DB_HOST": "rds.example", "SWEEP_DB_NAME": "optuna"}, secret_id="rds!db-123")
    assert got.url.endswith("@rds.example:5432/optuna")


def test_missing_secret_is_bad_input(aws):
    with pytest.raises(BadInput, match="not found in us-east-2") as e:
        secrets.resolve(env={}, secret_id="nope")
    assert e.value.code == 2


@pytest.mark.parametrize("text, message", [
    ("", "empty"),
    ("{not json", "neither a URL nor valid JSON"),
    ("[1, 2]", "must be an object"),
    (json.dumps({"engine": "mysql", "username": "u", "password": "p", "host": "h"}), "not PostgreSQL"),
    (json.dumps({"username": "u", "host": "h"}), "missing password"),
    (json.dumps({"username": "u", "password": "p", "host": "h", "port": "x"}), "port must be a number"),
    ("mysql://u:p@h/db", "is not PostgreSQL"),
    ("just-a-word", "not a database URL"),
])
def test_malformed_secrets_name_the_problem_never_the_value(text, message):
    with pytest.raises(BadInput, match=message) as e:
        secrets.url_from_secret(text, "secret x")
    assert "secret x" in str(e.value) and "\n" not in str(e.value)
    if "p" in text:
        assert '"password"' not in str(e.value)


def test_file_secret_and_url_key(tmp_path):
    path = tmp_path / "db.json"
    path.write_text(json.dumps({"url": "postgresql+psycopg2://u:pw@10.0.0.5:5432/optuna"}))
    got = secrets.resolve(env={"SWEEP_DB_SECRET": f"file:{path}"})
    assert got.url.endswith("@10.0.0.5:5432/optuna") and got.source == f"file {path}"
    with pytest.raises(BadInput, match="no such file"):
        secrets.resolve(env={"SWEEP_DB_SECRET": f"file:{tmp_path / 'missing.json'}"})


def test_sslmode_passes_through():
    url = secrets.url_from_secret(rds_json(sslmode="require"), "s")
    assert url.endswith("/studies?sslmode=require")


def test_check_connection_reports_a_scrubbed_error():
    url = secrets.url_from_secret(rds_json(host="127.0.0.1", port=1), "s")
    with pytest.raises(InfraError) as e:
        secrets.check_connection(url, timeout_s=2)
    assert "s3cr" not in str(e.value) and "optuna:***@127.0.0.1:1" in str(e.value)


def test_redaction_survives_unquoted_passwords():
    """A hand-written URL whose password holds '/' or '@' is still redacted, and scrubbed from text."""
    url = f"postgresql+psycopg2://postgres:{PASSWORD}@127.0.0.1:1/postgres"
    assert secrets.redact(url) == "postgresql+psycopg2://postgres:***@127.0.0.1:1/postgres"
    assert "s3cr" not in secrets.scrub(f"failed: {url} and {PASSWORD}", url)
    with pytest.raises(InfraError) as e:
        secrets.check_connection(url, timeout_s=2)
    assert "s3cr" not in str(e.value)


# -- AMI ------------------------------------------------------------------------------------------

def test_ami_from_ssm_parameter(aws):
    ssm = boto3.client("ssm", region_name=REGION)
    ssm.put_parameter(Name="/test/neuron/dlami/image_id", Value="ami-0123456789abcdef0", Type="String")
    assert ami.resolve(ssm, "/test/neuron/dlami/image_id") == "ami-0123456789abcdef0"
    ssm.put_parameter(Name="/test/broken", Value="not-an-ami", Type="String")
    with pytest.raises(InfraError, match="not an AMI id"):
        ami.resolve(ssm, "/test/broken")


def test_ami_public_parameter_path_and_absence():
    ssm = boto3.client("ssm", region_name=REGION, aws_access_key_id="x", aws_secret_access_key="x")
    assert ami.DEFAULT_SSM_PARAMETER == "/aws/service/neuron/dlami/torch-neuronx-2.14.0/ubuntu-24.04/latest/image_id"
    with Stubber(ssm) as stub:
        stub.add_response("get_parameter", {"Parameter": {"Name": ami.DEFAULT_SSM_PARAMETER, "Type": "String",
                                                          "Value": "ami-0abcdef1234567890"}},
                          {"Name": ami.DEFAULT_SSM_PARAMETER})
        assert ami.resolve(ssm) == "ami-0abcdef1234567890"
        stub.add_client_error("get_parameter", service_error_code="ParameterNotFound", http_status_code=400)
        stub.add_response("get_parameters_by_path", {"Parameters": []},
                          {"Path": "/aws/service/neuron/dlami", "Recursive": True})
        with pytest.raises(BadInput, match="does not exist in us-east-2 .the Deep Learning AMI Neuron torch-neuronx"):
            ami.resolve(ssm)
    with pytest.raises(BadInput, match="starting with '/'"):
        ami.resolve(ssm, "aws/service/x")
    with pytest.raises(BadInput, match="not an AMI id"):
        ami.check_ami_id("ami-xyz")


def test_ami_finds_the_torchneuron_dlami_where_the_guessed_name_is_absent():
    """The default name is the documented pattern filled in; AWS's own listing decides where it differs."""
    ssm = boto3.client("ssm", region_name=REGION, aws_access_key_id="x", aws_secret_access_key="x")
    listed = ["/aws/service/neuron/dlami/multi-framework/ubuntu-24.04/latest/image_id",  # no PyTorch venv
              "/aws/service/neuron/dlami/pytorch-2.9/ubuntu-24.04/latest/image_id",  # the XLA line
              "/aws/service/neuron/dlami/pytorch-2.14/ubuntu-26.04/latest/image_id",  # another OS
              "/aws/service/neuron/dlami/pytorch-2.14/ubuntu-24.04/latest/image_id"]
    with Stubber(ssm) as stub:
        stub.add_client_error("get_parameter", service_error_code="ParameterNotFound", http_status_code=400)
        stub.add_response("get_parameters_by_path",
                          {"Parameters": [{"Name": n, "Type": "String", "Value": "ami-00000000000000000"}
                                          for n in listed[:2]], "NextToken": "t"},
                          {"Path": "/aws/service/neuron/dlami", "Recursive": True})
        stub.add_response("get_parameters_by_path",
                          {"Parameters": [{"Name": n, "Type": "String", "Value": "ami-00000000000000000"}
                                          for n in listed[2:]]},
                          {"Path": "/aws/service/neuron/dlami", "Recursive": True, "NextToken": "t"})
        stub.add_response("get_parameter", {"Parameter": {"Name": listed[3], "Type": "String",
                                                          "Value": "ami-0fedcba9876543210"}}, {"Name": listed[3]})
        assert ami.resolve(ssm) == "ami-0fedcba9876543210"
        stub.assert_no_pending_responses()


# -- IAM ------------------------------------------------------------------------------------------

def test_iam_profiles_scoped_to_bucket_and_secret(aws, monkeypatch):
    monkeypatch.setenv("MOTO_IAM_LOAD_MANAGED_POLICIES", "true")  # AmazonEC2FullAccess must exist (slow: only here)
    arn = sm().create_secret(Name="trnsweep/db", SecretString=rds_json())["ARN"]
    client = boto3.client("iam", region_name=REGION)
    out = iam.ensure(client, "trnsweep-bucket", iam.secret_arn(sm(), "trnsweep/db"))
    again = iam.ensure(client, "trnsweep-bucket", arn)  # idempotent
    assert out == again
    head = json.loads(json.dumps(client.get_role_policy(RoleName=iam.HEAD, PolicyName=iam.HEAD)["PolicyDocument"]))
    resources = {json.dumps(s["Resource"]) for s in head["Statement"]}
    assert json.dumps(arn) in resources and json.dumps(out["worker_role"]) in resources
    assert json.dumps("arn:aws:s3:::trnsweep-bucket/*") in resources
    worker = client.get_role_policy(RoleName=iam.WORKER, PolicyName=iam.WORKER)["PolicyDocument"]
    actions = {a for s in worker["Statement"] for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])}
    assert not any(a.startswith(("secretsmanager", "ec2", "iam")) for a in actions)
    for name in (iam.HEAD, iam.WORKER):
        roles = client.get_instance_profile(InstanceProfileName=name)["InstanceProfile"]["Roles"]
        assert [r["RoleName"] for r in roles] == [name]
    assert sorted(iam.delete(client)) == sorted([f"instance-profile/{iam.HEAD}", f"role/{iam.HEAD}",
                                                 f"instance-profile/{iam.WORKER}", f"role/{iam.WORKER}"])
    assert iam.delete(client) == []
    with pytest.raises(BadInput, match="create it first"):
        iam.secret_arn(sm(), "absent")


# -- security group -------------------------------------------------------------------------------

def test_security_group_ssh_from_cidr_and_members_only(aws):
    ec2 = boto3.client("ec2", region_name=REGION)
    out = network.ensure(ec2, "demo", ["203.0.113.7/32"])
    assert out["created"] and out["group_name"] == "trnsweep-demo" and out["warning"] is None
    again = network.ensure(ec2, "demo", ["203.0.113.7/32", "2001:db8::/64"])
    assert not again["created"] and again["group_id"] == out["group_id"]
    perms = ec2.describe_security_groups(GroupIds=[out["group_id"]])["SecurityGroups"][0]["IpPermissions"]
    open_ports, members = set(), set()
    for p in perms:
        for r in p.get("IpRanges", []) + p.get("Ipv6Ranges", []):
            open_ports.add((p.get("FromPort"), r.get("CidrIp") or r.get("CidrIpv6")))
        members |= {(p["IpProtocol"], g["GroupId"]) for g in p.get("UserIdGroupPairs", [])}
    assert open_ports == {(22, "203.0.113.7/32"), (22, "2001:db8::/64")}
    assert members == {("-1", out["group_id"])}  # every port between the group's own members, and no one else
    assert network.ensure(ec2, "demo", ["0.0.0.0/0"])["warning"]
    with pytest.raises(BadInput, match="not an IPv4/IPv6 network"):
        network.ensure(ec2, "demo", ["my-laptop"])
    with pytest.raises(BadInput, match="at least one"):
        network.ensure(ec2, "demo", [])


# -- sync -----------------------------------------------------------------------------------------

def test_sync_push_pull_respects_age_and_skips_partial_files(aws, tmp_path):
    buckets.ensure(s3(), "cache-bucket", REGION)
    src = tmp_path / "node-a"
    (src / "neff" / "MODULE_1").mkdir(parents=True)
    (src / "neff" / "MODULE_1" / "model.neff").write_bytes(b"x" * 100)
    (src / "neff" / "MODULE_1" / "compile.lock").write_text("busy")
    (src / "neff" / ".hidden").write_text("no")
    fresh = src / "neff" / "MODULE_2.neff"
    fresh.write_bytes(b"being written")
    old = time.time() - 3600
    os.utime(src / "neff" / "MODULE_1" / "model.neff", (old, old))

    assert sync.sync(s3(), str(src), "s3://cache-bucket/neuron-cache", min_age_s=300) == ("push", 1)
    keys = [o["Key"] for o in s3().list_objects_v2(Bucket="cache-bucket")["Contents"]]
    assert keys == ["neuron-cache/neff/MODULE_1/model.neff"]
    assert sync.sync(s3(), str(src), "s3://cache-bucket/neuron-cache", min_age_s=300) == ("push", 0)
    assert sync.sync(s3(), str(src), "s3://cache-bucket/neuron-cache", min_age_s=0) == ("push", 1)

    dst = tmp_path / "node-b"
    assert sync.sync(s3(), "s3://cache-bucket/neuron-cache", str(dst)) == ("pull", 2)
    assert (dst / "neff" / "MODULE_1" / "model.neff").read_bytes() == b"x" * 100
    assert not list(dst.rglob("*.partial"))
    assert sync.sync(s3(), "s3://cache-bucket/neuron-cache", str(dst)) == ("pull", 0)
    s3().put_object(Bucket="cache-bucket", Key="neuron-cache/../escape", Body=b"!")
    sync.sync(s3(), "s3://cache-bucket/neuron-cache", str(dst))
    assert not (tmp_path / "escape").exists()


def test_sync_arguments():
    with pytest.raises(BadInput, match="exactly one"):
        sync.sync(None, "a", "b")
    with pytest.raises(BadInput, match="exactly one"):
        sync.sync(None, "s3://a/x", "s3://b/y")
    assert sync.parse_s3("s3://b/p/q/") == sync.S3Url("b", "p/q")
    with pytest.raises(BadInput, match="no bucket"):
        sync.parse_s3("s3:///x")


# -- error translation ----------------------------------------------------------------------------

def test_errors_are_one_line_with_exit_codes(monkeypatch):
    from botocore.exceptions import ClientError, NoCredentialsError

    def boom():
        raise NoCredentialsError()

    with pytest.raises(InfraError, match="no AWS credentials") as e:
        call("S3 ListBuckets", boom)
    assert e.value.code == 1
    err = ClientError({"Error": {"Code": "ValidationException", "Message": "bad\nname"}}, "Op")
    t = translate(err, "thing")
    assert t.code == 2 and "\n" not in str(t) and str(t) == "thing: ValidationException: bad name"
    denied = translate(ClientError({"Error": {"Code": "AccessDenied", "Message": "no"}}, "Op"), "thing")
    assert denied.code == 1 and "access denied" in str(denied)
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    from infra.aws import region

    with pytest.raises(BadInput, match="no AWS region"):
        region()
    assert region("eu-north-1") == "eu-north-1"


def test_no_password_in_any_printed_path(tmp_path, capsys, monkeypatch):
    """db-url prints the redacted URL; a failed --check never leaks the password either."""
    from infra.cli import main

    path = tmp_path / "db.json"
    path.write_text(rds_json(host="127.0.0.1", port=1))
    monkeypatch.delenv("SWEEP_STORAGE", raising=False)
    assert main(["db-url", "--secret-id", f"file:{path}"]) == 0
    out = capsys.readouterr().out
    assert "optuna:***@127.0.0.1:1/studies" in out and "s3cr" not in out
    assert main(["db-url", "--secret-id", f"file:{path}", "--check"]) == 1
    captured = capsys.readouterr()
    assert "s3cr" not in captured.out + captured.err and captured.err.count("\n") == 1
    assert Path(path).exists()


# -- AMI pinned to the Neuron SDK of sweep/neuron/versions.py -----------------------------------------

LATEST = "/test/neuron/dlami/ubuntu-24.04/latest/image_id"  # moto reserves /aws/ for AWS itself


def _latest(value: str):
    ssm = boto3.client("ssm", region_name=REGION)
    ssm.put_parameter(Name=LATEST, Value=value, Type="String")
    return ssm, boto3.client("ec2", region_name=REGION)


def test_latest_is_taken_when_its_description_names_the_pinned_sdk(aws, monkeypatch):
    from sweep.neuron import versions

    publish(monkeypatch, dlami("ami-0000000000000a330", versions.NEURON_SDK))
    ssm, ec2 = _latest("ami-0000000000000a330")
    assert ami.resolve_pinned(ssm, ec2, LATEST) == "ami-0000000000000a330"
    assert ami.sdk_of("Deep Learning AMI Neuron ... Neuron SDK 2.34.0") == "2.34.0" and ami.sdk_of("none") is None


def test_once_latest_moves_to_another_release_the_pinned_releases_newest_image_is_taken(aws, monkeypatch):
    publish(monkeypatch,
            dlami("ami-0000000000000a340", "2.34.0", day="20261130"),  # what latest names now
            dlami("ami-0000000000000a331", "2.33.0", day="20261019"),
            dlami("ami-0000000000000a332", "2.33.0", day="20261105"),  # the newest 2.33.0 build: this one
            dlami("ami-0000000000000a326", "2.33.0", day="20261120",
                  name="Deep Learning AMI Neuron torch-neuronx 2.14.0 (Ubuntu 26.04)"),  # another OS
            dlami("ami-0000000000000a3f0", "2.33.0", day="20261121", name="Deep Learning AMI Neuron (Ubuntu 24.04)"),
            dlami("ami-0000000000000a320", "2.32.0", day="20261110"))
    ssm, ec2 = _latest("ami-0000000000000a340")
    assert ami.resolve_pinned(ssm, ec2, LATEST) == "ami-0000000000000a332"


@pytest.mark.parametrize("latest", ["ami-0000000000000a340", "ami-0000000000000dead"])  # 2.34.0; not visible
def test_no_image_of_the_pinned_release_is_refused_in_one_line(aws, monkeypatch, latest):
    publish(monkeypatch, dlami("ami-0000000000000a340", "2.34.0", day="20261130"))
    ssm, ec2 = _latest(latest)
    with pytest.raises(BadInput) as e:
        ami.resolve_pinned(ssm, ec2, LATEST)
    message = str(e.value)
    assert "\n" not in message and f"resolves to {latest}" in message and "not Neuron 2.33.0" in message
    assert ("Neuron SDK 2.34.0 in its description" in message) == latest.endswith("a340")
    assert "pass --ami" in message


def test_a_missing_ssm_parameter_falls_back_to_the_pinned_releases_image(aws, monkeypatch):
    """The parameter's name is a guess: where it does not exist, describe-images still finds the pinned image."""
    from sweep.neuron import versions

    publish(monkeypatch, dlami("ami-0000000000000a341", "2.34.0", day="20261130"),
            dlami("ami-0000000000000a333", versions.NEURON_SDK, day="20261105"))
    ssm, ec2 = boto3.client("ssm", region_name=REGION), boto3.client("ec2", region_name=REGION)
    assert ami.resolve_pinned(ssm, ec2, "/test/neuron/dlami/absent/image_id") == "ami-0000000000000a333"


def test_a_missing_ssm_parameter_and_no_pinned_image_is_refused_in_one_line(aws, monkeypatch):
    publish(monkeypatch, dlami("ami-0000000000000a341", "2.34.0", day="20261130"))
    ssm, ec2 = boto3.client("ssm", region_name=REGION), boto3.client("ec2", region_name=REGION)
    with pytest.raises(BadInput) as e:
        ami.resolve_pinned(ssm, ec2, "/test/neuron/dlami/absent/image_id")
    assert "\n" not in str(e.value) and "does not exist in us-east-2" in str(e.value) and "pass --ami" in str(e.value)

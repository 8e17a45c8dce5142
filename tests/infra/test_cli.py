"""``python -m infra`` end to end under moto: output, exit codes (0 / 1 / 2), and no password anywhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import boto3
import moto
import pytest

from infra.cli import main

ROOT = Path(__file__).resolve().parents[2]
REGION = "us-east-2"
PASSWORD = "Hunter2/with@odd:chars"


@pytest.fixture
def aws(monkeypatch, request):
    if "iam" in request.node.name:  # AmazonEC2FullAccess must exist; loading AWS policies is slow, so only here
        monkeypatch.setenv("MOTO_IAM_LOAD_MANAGED_POLICIES", "true")
    for var in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "SWEEP_STORAGE", "SWEEP_DB_SECRET", "SWEEP_DB_HOST",
                "SWEEP_DB_NAME"):
        monkeypatch.delenv(var, raising=False)
    for var, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                       ("AWS_REGION", REGION), ("AWS_DEFAULT_REGION", REGION), ("AWS_CONFIG_FILE", os.devnull),
                       ("AWS_SHARED_CREDENTIALS_FILE", os.devnull)):
        monkeypatch.setenv(var, value)
    with moto.mock_aws():
        yield


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert err.count("\n") <= 1, err  # every error is one line
    return code, out, err


def test_bucket_lifecycle(aws, capsys):
    code, out, _ = run(capsys, "bucket", "--json")
    data = json.loads(out)
    assert code == 0 and data["name"] == "trnsweep-123456789012-us-east-2" and data["created"]
    assert data["neuron_cache"] == "s3://trnsweep-123456789012-us-east-2/neuron-cache"
    code, out, _ = run(capsys, "bucket", "--name", data["name"])
    assert code == 0 and "exists; private, encrypted" in out
    code, _, err = run(capsys, "bucket-delete", data["name"])
    assert code == 2 and "--yes" in err
    code, out, _ = run(capsys, "bucket-delete", data["name"], "--yes")
    assert code == 0 and "deleted" in out
    code, _, err = run(capsys, "bucket", "--name", "Not_Valid")
    assert code == 2 and err.startswith("infra: bucket name 'Not_Valid'")


def test_security_group(aws, capsys):
    code, out, _ = run(capsys, "security-group", "--ssh-cidr", "198.51.100.4/32")
    assert code == 0 and "SSH from 198.51.100.4/32" in out
    code, _, err = run(capsys, "security-group", "--ssh-cidr", "nonsense")
    assert code == 2
    code, _, err = run(capsys, "security-group")
    assert code == 2 and "--ssh-cidr" in err


def test_iam(aws, capsys):
    boto3.client("secretsmanager", region_name=REGION).create_secret(Name="trnsweep/db", SecretString="{}")
    code, out, _ = run(capsys, "iam", "--bucket", "b-1", "--db-secret", "trnsweep/db")
    assert code == 0 and "trnsweep-head (head) and trnsweep-worker (workers): ready" in out
    code, _, err = run(capsys, "iam", "--bucket", "b-1", "--db-secret", "absent")
    assert code == 2 and "create it first" in err
    code, out, _ = run(capsys, "iam", "--delete")
    assert code == 0 and "role/trnsweep-head" in out


def test_db_url_from_secrets_manager_redacted(aws, capsys):
    sm = boto3.client("secretsmanager", region_name=REGION)
    sm.create_secret(Name="trnsweep/db", SecretString=json.dumps(
        {"username": "optuna", "password": PASSWORD, "host": "db.internal", "port": 5432, "dbname": "optuna"}))
    code, out, err = run(capsys, "db-url", "--secret-id", "trnsweep/db")
    assert code == 0 and out.strip() == ("postgresql+psycopg2://optuna:***@db.internal:5432/optuna "
                                         "(from secret trnsweep/db)")
    code, out, err = run(capsys, "db-url")
    assert code == 2 and "no database configured" in err
    code, out, err = run(capsys, "db-url", "--secret-id", "missing")
    assert code == 2 and "not found" in err
    assert "Hunter2" not in out + err


def test_ami_and_missing_region(aws, capsys, monkeypatch):
    from sweep.neuron import versions
    from tests.infra.dlami import image, publish

    publish(monkeypatch, image("ami-0aaaaaaaaaaaaaaaa", versions.NEURON_SDK))
    boto3.client("ssm", region_name=REGION).put_parameter(Name="/t/ami", Value="ami-0aaaaaaaaaaaaaaaa", Type="String")
    code, out, _ = run(capsys, "ami", "--ssm-parameter", "/t/ami")
    assert code == 0 and out.strip() == "ami-0aaaaaaaaaaaaaaaa"
    # moto does not publish the Neuron parameters: the pinned release's image is found with describe-images
    code, out, _ = run(capsys, "ami")
    assert code == 0 and out.strip() == "ami-0aaaaaaaaaaaaaaaa"
    monkeypatch.delenv("AWS_REGION")
    monkeypatch.delenv("AWS_DEFAULT_REGION")
    code, _, err = run(capsys, "ami")
    assert code == 2 and "no AWS region" in err


def test_capacity_and_check_report_what_is_missing(aws, capsys, monkeypatch):
    """moto offers trn2.48xlarge in us-east-2 but not trn2.3xlarge; quotas come from a fake (moto has no
    EC2 quotas; tests/infra/test_capacity.py covers the Service Quotas calls with Stubber)."""
    from infra import capacity

    limits = {"L-2C3B7624": 0.0, "L-1216C47A": 32.0}
    monkeypatch.setattr(capacity, "quota_value", lambda sq, code: limits.get(code))
    monkeypatch.setattr(capacity, "reservations", lambda ec2, types: [])
    code, out, _ = run(capsys, "capacity", "--need", "trn2.48xlarge=1", "--json")
    data = json.loads(out)
    assert code == 1 and data["zones"]["trn2.48xlarge"] == ["us-east-2a", "us-east-2b", "us-east-2c"]
    assert len(data["missing"]) == 1 and "Running On-Demand Trn instances is 0 vCPU" in data["missing"][0]
    code, out, _ = run(capsys, "capacity", "--need", "trn2.3xlarge=2")
    assert code == 1 and "trn2.3xlarge: NOT offered in this region" in out
    code, _, err = run(capsys, "capacity", "--need", "p5.48xlarge=1")
    assert code == 2 and "only trn" in err
    code, out, _ = run(capsys, "check", "--bucket", "absent-bucket", "--need", "trn2.48xlarge=1")
    assert code == 1 and "problem: bucket absent-bucket does not exist" in out
    assert out.strip().endswith("problem(s)")


def test_sync_cli(aws, capsys, tmp_path):
    boto3.client("s3", region_name=REGION).create_bucket(Bucket="cache-b", CreateBucketConfiguration={
        "LocationConstraint": REGION})
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "f.neff").write_text("x")
    code, out, _ = run(capsys, "sync", str(tmp_path / "a"), "s3://cache-b/neuron-cache", "--min-age-s", "0")
    assert code == 0 and "sync push" in out and "1 file(s)" in out
    code, out, _ = run(capsys, "sync", "s3://cache-b/neuron-cache", str(tmp_path / "b"), "--quiet")
    assert code == 0 and out == "" and (tmp_path / "b" / "f.neff").read_text() == "x"
    code, _, err = run(capsys, "sync", "a", "b")
    assert code == 2


def test_usage_errors_are_exit_2(capsys):
    for argv in ([], ["nope"], ["cost"], ["render-cluster", "--lnc", "3"], ["capacity", "--need", "x"]):
        code, _, err = run(capsys, *argv)
        assert code == 2 and err.startswith("infra: "), argv


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SWEEP_", "AWS_"))}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def test_with_db_sets_sweep_storage_only_in_the_child(tmp_path):
    secret = tmp_path / "db.json"
    secret.write_text(json.dumps({"username": "optuna", "password": PASSWORD, "host": "10.1.2.3",
                                  "dbname": "optuna"}))
    probe = ("import os; u = os.environ['SWEEP_STORAGE']; "
             "print(u.startswith('postgresql+psycopg2://optuna:'), u.endswith('@10.1.2.3:5432/optuna'))")
    out = subprocess.run([sys.executable, "-m", "infra", "with-db", "--", sys.executable, "-c", probe],
                         env=child_env(SWEEP_DB_SECRET=f"file:{secret}"), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.split() == ["True", "True"] and "Hunter2" not in out.stdout + out.stderr
    # Nothing configured: the command runs unchanged (the sweep keeps its local default store).
    out = subprocess.run([sys.executable, "-m", "infra", "with-db", "--", sys.executable, "-c",
                          "import os; print(os.environ.get('SWEEP_STORAGE'))"],
                         env=child_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "None"
    # The child's exit status is the command's.
    out = subprocess.run([sys.executable, "-m", "infra", "with-db", "--", sys.executable, "-c", "raise SystemExit(7)"],
                         env=child_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 7
    out = subprocess.run([sys.executable, "-m", "infra", "with-db", "--", "/no/such/program"],
                         env=child_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and out.stderr.startswith("infra: with-db: cannot run")
    out = subprocess.run([sys.executable, "-m", "infra", "with-db", "--secret-id", f"file:{tmp_path}/absent", "--",
                          "true"], env=child_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "no such file" in out.stderr

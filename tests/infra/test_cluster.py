"""The Ray cluster config for trn2: template and rendered files against Ray's own schema and AWS bootstrap.

``validate`` runs Ray 2.60's ``validate_config`` (the JSON schema shipped as
``ray/autoscaler/ray-schema.json`` plus its cross-field checks); the bootstrap test runs Ray's own AWS
``bootstrap_aws`` (key pair, subnets, security group, AMI) against moto.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import boto3
import jsonschema
import pytest
import yaml

from infra import cluster, network
from infra.aws import BadInput, InfraError
from infra.cli import main
from sweep.neuron import versions
from tests.ci import under_ci
from tests.infra.dlami import image as dlami
from tests.infra.dlami import publish

REGION = "us-east-2"
AMI = "ami-0123456789abcdef0"
RAY_SCHEMA = Path(__import__("ray.autoscaler", fromlist=["x"]).__file__).parent / "ray-schema.json"


def options(tmp_path, **over):
    token = tmp_path / "auth_token"
    token.write_text("token-not-a-secret-here")
    base = {"region": REGION, "ami": AMI, "bucket": "trnsweep-123-us-east-2", "zones": ["us-east-2a", "us-east-2b"],
            "auth_token": token, "out_dir": tmp_path / "out"}
    return cluster.Options(**{**base, **over})


def test_ray_schema_file_is_the_one_validated_against():
    schema = json.loads(RAY_SCHEMA.read_text())
    assert "available_node_types" in schema["properties"]
    template = cluster.load_template()
    jsonschema.validate(template, schema)  # the raw template, placeholders and all, is already well-formed


def test_template_declares_neuron_cores_and_scales_from_zero():
    types = cluster.load_template()["available_node_types"]
    assert types["head"]["resources"] == {"CPU": 0}
    for name in (cluster.SMALL, cluster.LARGE):
        assert types[name]["min_workers"] == 0 and "neuron_cores" in types[name]["resources"]


@pytest.mark.parametrize("lnc, small, large", [(2, 4, 64), (1, 8, 128)])
def test_neuron_cores_follow_the_logical_core_config(tmp_path, lnc, small, large):
    cfg = cluster.render(options(tmp_path, lnc=lnc, max_large=1))
    types = cfg["available_node_types"]
    assert types[cluster.SMALL]["resources"] == {"CPU": 12, "neuron_cores": small}
    assert types[cluster.LARGE]["resources"] == {"CPU": 192, "neuron_cores": large}
    assert cfg["max_workers"] == 9 and types[cluster.LARGE]["max_workers"] == 1
    assert f"export NEURON_LOGICAL_NC_CONFIG={lnc}" in cluster.env_file(options(tmp_path, lnc=lnc))


def test_rendered_config_details(tmp_path):
    cfg = cluster.render(options(tmp_path))
    assert cfg["provider"] == {"type": "aws", "region": REGION, "availability_zone": "us-east-2a,us-east-2b",
                               "cache_stopped_nodes": False, "security_group": {"GroupName": "trnsweep"}}
    nodes = cfg["available_node_types"]
    assert {n["node_config"]["ImageId"] for n in nodes.values()} == {AMI}
    assert nodes["head"]["node_config"]["IamInstanceProfile"] == {"Name": "trnsweep-head"}
    assert all("InstanceMarketOptions" not in n["node_config"] for n in nodes.values())
    assert "bash ~/trnsweep/infra/ray/head_postgres.sh" in cfg["head_setup_commands"]
    start = " ".join(cfg["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in start and "cluster.env" in start
    assert "TORCH_PIN='torch==2.13.0'" in " ".join(cfg["head_setup_commands"])  # the head: CPU torch
    workers = " ".join(cfg["worker_setup_commands"])  # trn2: the TorchNeuron DLAMI's venv, then the pinned extra
    assert "make install" not in workers and "torch==2.13.0" not in workers
    assert f"worker_venv.sh '{versions.DLAMI_VENV}'" in workers and "-e '.[neuron]'" in workers
    assert "pip.repos.neuron.amazonaws.com" in workers
    assert workers.index("worker_venv.sh") < workers.index("pip install")
    text = yaml.safe_dump(cfg)
    assert "@" not in text.replace("user@", "")  # no placeholder left


def test_spot_and_external_database(tmp_path):
    cfg = cluster.render(options(tmp_path, spot=True, db="secret", db_secret="trnsweep/db", cluster_name="phase1"))
    nodes = cfg["available_node_types"]
    assert nodes[cluster.SMALL]["node_config"]["InstanceMarketOptions"] == {"MarketType": "spot"}
    assert "InstanceMarketOptions" not in nodes["head"]["node_config"]  # the head is never spot
    assert not any("head_postgres" in c for c in cfg["head_setup_commands"])
    assert cfg["provider"]["security_group"]["GroupName"] == "trnsweep-phase1"
    env = cluster.env_file(options(tmp_path, db="secret", db_secret="trnsweep/db", db_host="db.x.rds.amazonaws.com",
                                  db_name="optuna"))
    assert "export SWEEP_DB_SECRET=trnsweep/db" in env and "export SWEEP_DB_HOST=db.x.rds.amazonaws.com" in env
    assert "export SWEEP_DB_NAME=optuna" in env
    with pytest.raises(BadInput, match="--db-host"):
        cluster.render(options(tmp_path, db="secret", db_secret="s", db_host="x; rm -rf /"))


@pytest.mark.parametrize("over, message", [
    ({"lnc": 4}, "--lnc must be 1 or 2"),
    ({"max_small": 0, "max_large": 0}, "at least one worker"),
    ({"db": "secret"}, "needs --db-secret"),
    ({"db": "sqlite"}, "--db must be"),
    ({"cluster_name": "Bad Name"}, "--cluster-name"),
    ({"torch_pin": "torch>=2"}, "expected torch==VERSION"),
    ({"zones": []}, "no availability zones"),
])
def test_bad_options(tmp_path, over, message):
    with pytest.raises(BadInput, match=message):
        cluster.render(options(tmp_path, **over))


def test_schema_violation_is_one_line(tmp_path):
    template = cluster.load_template()
    template["available_node_types"][cluster.SMALL]["resources"]["neuron_cores"] = "four"
    template["available_node_types"][cluster.SMALL]["bogus"] = 1
    with pytest.raises(InfraError, match="fails Ray's schema at available_node_types/trn2-3xlarge") as e:
        cluster.validate(template)
    assert "\n" not in str(e.value)
    broken = cluster.load_template()
    broken["head_node_type"] = "nope"
    with pytest.raises(InfraError, match="head_node_type"):
        cluster.validate(broken)


def test_write_snapshot_env_and_file(tmp_path):
    paths = cluster.write(options(tmp_path))
    text = paths["config"].read_text()
    assert text.startswith("# Generated by `python -m infra render-cluster`")
    cfg = yaml.safe_load(text)
    cluster.validate(cfg)
    jsonschema.validate(cfg, json.loads(RAY_SCHEMA.read_text()))
    src = paths["source"]
    assert cfg["file_mounts"]["~/trnsweep"] == str(src.resolve())
    assert (src / "infra" / "ray" / "trn2.yaml").is_file() and (src / "Makefile").is_file()
    assert not (src / ".venv").exists() and not (src / "runs").exists() and not (src / ".git").exists()
    env = paths["env"].read_text()
    assert "RAY_AUTH_MODE=token" in env and "TRNSWEEP_S3=s3://trnsweep-123-us-east-2" in env
    assert "password" not in env.lower()
    # The env file is valid shell and sets what the node scripts rely on.
    show = 'echo "$SWEEP_ARTIFACTS|$TRNSWEEP_TRIAL_FILES|$TORCH_NEURONX_NEFF_CACHE_DIR|$SWEEP_DB_SECRET"'
    out = subprocess.run(["bash", "-c", f'set -eu; HOME=/home/ubuntu; . "{paths["env"]}"; {show}'],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == ("s3://trnsweep-123-us-east-2/artifacts|/home/ubuntu/trnsweep/runs/artifacts|"
                   "/home/ubuntu/neuron-cache/neff|file:/home/ubuntu/.trnsweep/db.json")


def test_missing_auth_token_is_bad_input(tmp_path):
    opts = options(tmp_path)
    opts.auth_token = tmp_path / "absent"
    with pytest.raises(BadInput, match="ray get-auth-token --generate"):
        cluster.write(opts)


def test_makefile_torch_pin(tmp_path):
    assert cluster.makefile_torch_pin() == "torch==2.13.0"
    (tmp_path / "Makefile").write_text("TORCH_PIN ?= torch==9.9.9\n")
    assert cluster.makefile_torch_pin(tmp_path / "Makefile") == "torch==9.9.9"
    assert cluster.makefile_torch_pin(tmp_path / "none") == cluster.DEFAULT_TORCH_PIN


@pytest.fixture
def moto_aws(monkeypatch, tmp_path):
    import moto
    for var in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    for var, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                       ("AWS_REGION", REGION), ("AWS_DEFAULT_REGION", REGION), ("AWS_CONFIG_FILE", os.devnull),
                       ("AWS_SHARED_CREDENTIALS_FILE", os.devnull), ("HOME", str(tmp_path / "home"))):
        monkeypatch.setenv(var, value)
    (tmp_path / "home").mkdir()
    with moto.mock_aws():
        yield


def test_ray_aws_bootstrap_accepts_the_config(moto_aws, tmp_path):
    """Ray's own `ray up` preparation, against moto: our security group is used as is (SSH from the
    operator only, no 0.0.0.0/0 added), subnets come only from our zones, our instance profiles stay."""
    from ray.autoscaler._private.aws.config import bootstrap_aws
    from ray.autoscaler._private.util import prepare_config, validate_config

    ec2 = boto3.client("ec2", region_name=REGION)
    sg = network.ensure(ec2, "trnsweep", ["203.0.113.7/32"])
    config = prepare_config(copy.deepcopy(cluster.render(options(tmp_path))))
    validate_config(config)
    out = bootstrap_aws(config)
    zone_of = {s["SubnetId"]: s["AvailabilityZone"] for s in ec2.describe_subnets()["Subnets"]}
    for name, node in out["available_node_types"].items():
        nc = node["node_config"]
        assert nc["SecurityGroupIds"] == [sg["group_id"]], name
        assert {zone_of[s] for s in nc["SubnetIds"]} == {"us-east-2a", "us-east-2b"}
        assert nc["IamInstanceProfile"]["Name"] == ("trnsweep-head" if name == "head" else "trnsweep-worker")
    perms = ec2.describe_security_groups(GroupIds=[sg["group_id"]])["SecurityGroups"][0]["IpPermissions"]
    cidrs = {r["CidrIp"] for p in perms for r in p.get("IpRanges", [])}
    assert cidrs == {"203.0.113.7/32"}
    assert Path(out["auth"]["ssh_private_key"]).is_file()


def test_cli_render(moto_aws, tmp_path, capsys, monkeypatch):
    publish(monkeypatch, dlami(AMI, versions.NEURON_SDK))
    ssm = boto3.client("ssm", region_name=REGION)
    ssm.put_parameter(Name="/test/neuron/image_id", Value=AMI, Type="String")
    token = tmp_path / "tok"
    token.write_text("t")
    args = ["render-cluster", "--profile", "latest-sdk", "--ssm-parameter", "/test/neuron/image_id", "--bucket", "b-1",
            "--auth-token", str(token), "--out-dir", str(tmp_path / "out")]
    # moto's offering table lacks trn2.3xlarge: --zones auto then reports where nothing is offered.
    assert main(args) == 2
    assert "trn2.3xlarge: nowhere" in capsys.readouterr().err
    assert main(args + ["--zones", "us-east-2a", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ami"] == AMI and data["zones"] == ["us-east-2a"]
    assert yaml.safe_load(Path(data["config"]).read_text())["provider"]["availability_zone"] == "us-east-2a"
    assert main(args + ["--zones", "eu-west-1a"]) == 2
    assert "not zones of us-east-2" in capsys.readouterr().err


def test_a_cluster_rendered_after_latest_moved_on_boots_the_pinned_release(moto_aws, tmp_path, capsys, monkeypatch):
    """SSM's latest names Neuron 2.34.0 while the pins are 2.33.0's: every node type gets the 2.33.0 image's id."""
    publish(monkeypatch, dlami("ami-0000000000000a340", "2.34.0", day="20261130"),
            dlami("ami-0000000000000a330", versions.NEURON_SDK, day="20261019"))
    ssm = boto3.client("ssm", region_name=REGION)
    ssm.put_parameter(Name="/test/neuron/image_id", Value="ami-0000000000000a340", Type="String")
    token = tmp_path / "tok"
    token.write_text("t")
    args = ["render-cluster", "--profile", "latest-sdk", "--ssm-parameter", "/test/neuron/image_id", "--bucket", "b-1",
            "--auth-token", str(token), "--out-dir", str(tmp_path / "out"), "--zones", "us-east-2a", "--json"]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    config = yaml.safe_load(Path(data["config"]).read_text())
    images = {n: t["node_config"]["ImageId"] for n, t in config["available_node_types"].items()}
    assert data["ami"] == "ami-0000000000000a330" and set(images.values()) == {"ami-0000000000000a330"}
    ec2 = boto3.client("ec2", region_name=REGION)
    ec2.deregister_image(ImageId="ami-0000000000000a330")  # no image of the pinned release left: refused
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "ami-0000000000000a340" in err and "Neuron SDK 2.34.0" in err


def test_a_competition_cluster_boots_the_kits_image_and_installs_nothing_into_its_venv(tmp_path):
    """The rendered files: every node the image by id; the workers find the image venv and only read it, the
    service gets its own venv (make install), and no command pip-installs into, or builds on, the image venv."""
    from sweep.neuron import environment

    opts = options(tmp_path, ami=environment.COMPETITION_AMI, profile="competition")
    cfg = cluster.render(opts)
    assert {n["node_config"]["ImageId"] for n in cfg["available_node_types"].values()} == {"ami-0d5703e99c1589f8d"}
    workers = cfg["worker_setup_commands"]
    assert workers[0] == f"bash ~/trnsweep/infra/ray/image_venv.sh '{environment.COMPETITION_VENV}'"
    assert "make install TORCH_PIN='torch==2.13.0'" in workers[1] and workers[1].startswith("cd ~/trnsweep && ")
    everything = yaml.safe_dump(cfg)
    assert "worker_venv.sh" not in everything and ".[neuron]" not in everything and "/opt/aws_neuronx_venv" not in \
        everything
    for command in workers + cfg["setup_commands"] + cfg["worker_start_ray_commands"]:
        if environment.COMPETITION_VENV in command:  # the one command naming the venv only looks for it
            assert command == workers[0]
    env = cluster.env_file(opts)
    assert "export TRNSWEEP_ENV_PROFILE=competition" in env
    assert f"export TRNSWEEP_IMAGE_VENV={environment.COMPETITION_VENV}" in env
    latest = cluster.env_file(options(tmp_path))
    assert "export TRNSWEEP_ENV_PROFILE=latest-sdk" in latest and "TRNSWEEP_IMAGE_VENV" not in latest
    with pytest.raises(BadInput):
        cluster.render(options(tmp_path, profile="scorer"))


def test_image_venv_finds_the_venv_by_name_and_writes_nothing(tmp_path):
    home = tmp_path / "home"
    venv = home / "neurips-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    before = sorted(str(p) for p in venv.rglob("*"))
    script = str(cluster.TEMPLATE.parent / "image_venv.sh")
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(["bash", script, "neurips-venv"], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(venv / "bin" / "python")
    assert subprocess.run(["bash", script, str(venv)], env=env, capture_output=True, text=True,
                          check=True).stdout.strip() == str(venv / "bin" / "python")
    assert sorted(str(p) for p in venv.rglob("*")) == before
    missing = subprocess.run(["bash", script, "other"], env=env, capture_output=True, text=True)
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1 and "no venv other" in missing.stderr


def test_cli_render_competition_checks_the_image_in_the_region(moto_aws, tmp_path, capsys, monkeypatch):
    from sweep.neuron import environment

    publish(monkeypatch, dlami(environment.COMPETITION_AMI, "2.31.0", name="neurips competition image"))
    token = tmp_path / "tok"
    token.write_text("t")
    args = ["render-cluster", "--bucket", "b-1", "--auth-token", str(token), "--out-dir", str(tmp_path / "out"),
            "--zones", "us-east-2a", "--json"]
    assert main(args) == 0  # the default profile: competition
    data = json.loads(capsys.readouterr().out)
    assert data["ami"] == environment.COMPETITION_AMI
    config = yaml.safe_load(Path(data["config"]).read_text())
    assert config["worker_setup_commands"][0].startswith("bash ~/trnsweep/infra/ray/image_venv.sh")
    boto3.client("ec2", region_name=REGION).deregister_image(ImageId=environment.COMPETITION_AMI)
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "ami-0d5703e99c1589f8d is not visible to describe-images in us-east-2" in err


def test_node_scripts_parse():
    for script in ("head_postgres.sh", "node_sync.sh", "worker_venv.sh", "image_venv.sh", "trial_user.sh"):
        subprocess.run(["bash", "-n", str(cluster.TEMPLATE.parent / script)], check=True)


def test_nodes_have_the_neuron_tools_on_path(tmp_path):
    env = cluster.env_file(options(tmp_path))
    assert 'export PATH="$PATH:/opt/aws/neuron/bin"' in env
    assert "TORCH_NEURONX_NEFF_CACHE_DIR" in env
    out = subprocess.run(["bash", "-c", f"PATH=/usr/bin:/bin; HOME={tmp_path}; {env}\necho $PATH"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip().split(":")[-1] == "/opt/aws/neuron/bin"


def test_worker_venv_sees_the_dlami_venvs_packages_without_writing_to_it(tmp_path):
    """A stand-in DLAMI venv holding a package; the worker's venv imports it from there."""
    dlami = tmp_path / "opt" / "aws_neuronx_venv_torch_neuronx_2_14_0"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dlami)], check=True)
    site = subprocess.run([str(dlami / "bin" / "python"), "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "torch_neuronx_standin_marker.py").write_text("FROM = 'dlami'\n")
    before = sorted(p.name for p in Path(site).iterdir())
    venv = tmp_path / "trnsweep" / ".venv"
    script = str(cluster.TEMPLATE.parent / "worker_venv.sh")
    for _ in range(2):  # idempotent: setup commands run again on every `ray up`
        subprocess.run(["bash", script, str(dlami), str(venv)], check=True, capture_output=True)
    out = subprocess.run([str(venv / "bin" / "python"), "-c",
                          "import torch_neuronx_standin_marker as m, sys; print(m.FROM, m.__file__, sys.prefix)"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "dlami" and out[1].startswith(site) and out[2] == str(venv)
    assert sorted(p.name for p in Path(site).iterdir()) == before  # nothing written into the DLAMI's venv
    missing = subprocess.run(["bash", script, str(tmp_path / "nope"), str(venv)], capture_output=True, text=True)
    assert missing.returncode == 1 and "boot the TorchNeuron DLAMI" in missing.stderr


def _local_postgres() -> bool:
    return shutil.which("psql") is not None and subprocess.run(
        ["pg_isready", "-q", "-h", "127.0.0.1", "-p", "5432"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _local_postgres() and not under_ci(),
                    reason="needs the PostgreSQL at 127.0.0.1:5432 (.ci/run starts it)")
def test_head_postgres_sql_is_idempotent_and_grants_login(tmp_path):
    """The SQL half of head_postgres.sh, run twice against the local server as user postgres."""
    lines = cluster.TEMPLATE.parent.joinpath("head_postgres.sh").read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("sudo -u postgres psql"))
    end = next(i for i in range(start + 1, len(lines)) if lines[i] == "SQL")
    block = "\n".join(["psql -h 127.0.0.1 -U postgres" + lines[start][len("sudo -u postgres psql"):],
                       *lines[start + 1:end + 1]])
    env = {**os.environ, "DB_USER": "trnsweep_it", "DB_NAME": "trnsweep_it_db", "PASSWORD": "pw_Z-9x"}
    try:
        for _ in range(2):
            subprocess.run(["bash", "-c", block], env=env, check=True, capture_output=True, timeout=60)
        import psycopg2

        psycopg2.connect(host="127.0.0.1", user="trnsweep_it", password="pw_Z-9x", dbname="trnsweep_it_db").close()
    finally:
        subprocess.run(["psql", "-h", "127.0.0.1", "-U", "postgres", "-q", "-c",
                        "DROP DATABASE IF EXISTS trnsweep_it_db", "-c", "DROP ROLE IF EXISTS trnsweep_it"],
                       capture_output=True, timeout=60)


def test_scale_requests_one_bundle_per_worker(monkeypatch, capsys):
    from infra import scale

    calls = []

    class FakeSdk:
        @staticmethod
        def request_resources(bundles):
            calls.append(bundles)

    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    assert scale.cores_per_worker("trn2.3xlarge") == 8 and scale.cores_per_worker("trn2.48xlarge", 2) == 64
    assert scale.request(3, 4, sdk=FakeSdk) == [{"neuron_cores": 4.0}] * 3
    assert scale.request(0, 4, sdk=FakeSdk) == [] and calls == [[{"neuron_cores": 4.0}] * 3, []]
    monkeypatch.setattr(scale, "request", lambda workers, cores: scale.bundles(workers, cores))
    assert main(["scale", "--workers", "2", "--lnc", "2"]) == 0
    assert "requested 2 x trn2.3xlarge (4 neuron_cores each)" in capsys.readouterr().out
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "4")
    assert main(["scale", "--workers", "1"]) == 2
    assert "must be 1 or 2" in capsys.readouterr().err


def test_a_worker_runs_the_preflight_before_ray_start_and_stays_out_when_it_fails(tmp_path):
    """The rendered start commands, run by bash against a stand-in venv: the preflight's exit decides."""
    types = cluster.render(options(tmp_path))["available_node_types"]
    start = yaml.safe_load(cluster.TEMPLATE.read_text())["worker_start_ray_commands"]
    at = [i for i, c in enumerate(start) if "-m sweep preflight" in c]
    ray_start = [i for i, c in enumerate(start) if "ray start" in c]
    assert len(at) == 1 and ray_start and at[0] < min(ray_start) and "ray stop" in start[0]
    assert types["trn2-3xlarge"]["resources"]["neuron_cores"] == 4  # what a node that passes advertises
    home = tmp_path / "home"
    venv = home / "trnsweep" / ".venv" / "bin"
    venv.mkdir(parents=True)
    (home / "trnsweep" / "cluster.env").write_text("export TRNSWEEP_PREFLIGHT_STUDY=phase1\n")
    (venv / "python").write_text('#!/bin/sh\necho "$@" > "$HOME/args"\necho "preflight failed at kernels" >&2\n'
                                 'exit "$FAKE_RC"\n')
    (venv / "python").chmod(0o755)
    for rc in (0, 1):
        env = {"HOME": str(home), "PATH": os.environ["PATH"], "FAKE_RC": str(rc)}
        run = subprocess.run(["bash", "-c", start[at[0]]], env=env, capture_output=True, text=True)
        assert run.returncode == rc, run.stderr
        assert (home / "args").read_text().split() == ["-m", "sweep", "preflight", "phase1"]
        assert ("preflight failed at kernels" in run.stderr) == bool(rc)
        assert (home / ".cache" / "trnsweep" / "preflight.log").exists()


def test_workers_make_the_trial_user_and_run_ray_as_root_so_script_trials_use_it(tmp_path):
    """cluster.env names the trial user (sweep/run/trialuser.py reads it); each worker makes it before Ray starts,
    and Ray (so the supervisor) runs as root, which starting a process as another user needs."""
    opts = options(tmp_path)
    env = cluster.env_file(opts)
    assert f"export SWEEP_TRIAL_USER={cluster.TRIAL_USER}" in env and cluster.TRIAL_USER == "trnsweep-trial"
    out = subprocess.run(["bash", "-c", f"HOME={tmp_path}; {env}\necho $SWEEP_TRIAL_USER"], capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "trnsweep-trial"
    cfg = cluster.render(opts)
    setup = [c for c in cfg["worker_setup_commands"] if "trial_user.sh" in c]
    assert setup == ["sudo bash ~/trnsweep/infra/ray/trial_user.sh 'trnsweep-trial' \"$HOME\""]
    start = [c for c in cfg["worker_start_ray_commands"] if "ray start" in c]
    assert len(start) == 1 and "sudo --preserve-env" in start[0]
    assert start[0].index("sudo") < start[0].index("ray start")
    assert "sudo ~/trnsweep/.venv/bin/ray stop" in cfg["worker_start_ray_commands"][0]
    script = (cluster.TEMPLATE.parent / "trial_user.sh").read_text()
    for step in ("useradd --system --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin",
                 'chmod 711 "$home"', 'chmod 700 "$home/.ray"', "chmod 700 /tmp/ray",
                 "--uid-owner \"$user\" -d 169.254.169.254 -j REJECT"):
        assert step in script, step

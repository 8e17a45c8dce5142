"""``python -m infra COMMAND``: the AWS side of trnsweep, one small command per step of docs/aws.md.

Exit codes follow the project: 0 success, 2 bad input (one line naming the cause), 1 anything else
(also "capacity missing"). Nothing printed ever contains a database password.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from infra import ami, aws, buckets, capacity, cluster, cost, iam, network, scale, secrets, sync
from infra.aws import BadInput, InfraError
from sweep.neuron import environment
from sweep.redact import scrub


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as one line and exit 2, like every other error here."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise BadInput(f"{self.prog}: {message}")


def _region(args: argparse.Namespace) -> str:
    return aws.region(getattr(args, "region", None))


def _emit(args: argparse.Namespace, data: dict[str, Any], lines: list[str]) -> None:
    if getattr(args, "json", False):
        print(json.dumps(data, sort_keys=True, default=str))
    else:
        print("\n".join(lines))


# -- commands -------------------------------------------------------------------------------------

def cmd_ami(args: argparse.Namespace) -> int:

    region = _region(args)
    print(ami.resolve_pinned(aws.client("ssm", region), aws.client("ec2", region), args.ssm_parameter))
    return 0


def cmd_render(args: argparse.Namespace) -> int:

    region = _region(args)
    opts = cluster.Options(
        region=region, ami="", bucket="", zones=["pending"], cluster_name=args.cluster_name,
        head_type=args.head_type, lnc=args.lnc, spot=args.spot, max_small=args.max_3xl, max_large=args.max_48xl,
        db=args.db, db_secret=args.db_secret, db_host=args.db_host, db_name=args.db_name,
        torch_pin=args.torch_pin or cluster.makefile_torch_pin(),
        auth_token=Path(args.auth_token), out_dir=Path(args.out_dir) if args.out_dir else None,
        profile=args.profile, image_venv=args.image_venv)
    opts.check()  # flag mistakes before any AWS call
    if args.profile == environment.COMPETITION:  # the kit's image by id, checked where the cluster will run
        image = ami.competition_image(aws.client("ec2", region), ami.check_ami_id(args.ami) if args.ami
                                      else environment.COMPETITION_AMI)
    else:
        image = (ami.check_ami_id(args.ami) if args.ami
                 else ami.resolve_pinned(aws.client("ssm", region), aws.client("ec2", region), args.ssm_parameter))
    if args.zones == "auto":
        types = ([args.head_type] + (["trn2.3xlarge"] if args.max_3xl else [])
                 + (["trn2.48xlarge"] if args.max_48xl else []))
        zones = capacity.zones_offering(aws.client("ec2", region), types)
    else:
        zones = [z.strip() for z in args.zones.split(",") if z.strip()]
        bad = [z for z in zones if not z.startswith(region)]
        if bad:
            raise BadInput(f"--zones {', '.join(bad)}: not zones of {region}")
    bucket = args.bucket or _default_bucket(region)
    opts.ami, opts.zones, opts.bucket = image, zones, bucket
    paths = cluster.write(opts)
    _emit(args, {k: str(v) for k, v in paths.items()} | {"ami": image, "zones": zones, "bucket": bucket},
          [f"cluster config: {paths['config']}", f"  image {image}, zones {', '.join(zones)}, bucket {bucket}",
           f"  environment {args.profile}"
           + (f" (trainers run the image venv {args.image_venv}'s python; nothing installed into it)"
              if args.profile == environment.COMPETITION else ""),
           f"  checkout snapshot {paths['source']} (re-render after changing the code)",
           f"next: ray up {paths['config']}"])
    return 0


def _default_bucket(region: str) -> str:

    return buckets.default_name(aws.account_id(region), region)


def cmd_bucket(args: argparse.Namespace) -> int:

    region = _region(args)
    name = args.name or _default_bucket(region)
    b = buckets.ensure(aws.client("s3", region), name, region, kms_key_id=args.kms_key_id)
    _emit(args, {"name": b.name, "region": b.region, "created": b.created, "artifacts": b.artifacts_url,
                 "neuron_cache": b.cache_url},
          [f"bucket {b.name} ({b.region}): {'created' if b.created else 'exists'}; private, encrypted",
           f"  artifacts    {b.artifacts_url}", f"  neuron cache {b.cache_url}"])
    return 0


def cmd_bucket_delete(args: argparse.Namespace) -> int:

    if not args.yes:
        raise BadInput(f"bucket-delete {args.name}: deletes every object and the bucket; add --yes to confirm")
    n = buckets.delete(aws.client("s3", _region(args)), args.name)
    print(f"bucket {args.name}: deleted with {n} object version(s)")
    return 0


def cmd_db_url(args: argparse.Namespace) -> int:

    resolved = secrets.resolve(secret_id=args.secret_id, region_name=args.region, host=args.db_host,
                               dbname=args.db_name)
    if resolved is None:
        raise BadInput(f"no database configured: set {secrets.ENV_STORAGE} or {secrets.ENV_SECRET}, "
                       "or pass --secret-id")
    line = f"{secrets.redact(resolved.url)} (from {resolved.source})"
    if args.check:
        line += f"; connected, server {secrets.check_connection(resolved.url)}"
    print(line)
    return 0


def cmd_with_db(args: argparse.Namespace) -> int:
    """Run a command with SWEEP_STORAGE set from the secret; with nothing configured, run it unchanged."""

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise BadInput("with-db: no command given (python -m infra with-db -- make sweep STUDY=phase1)")
    resolved = secrets.resolve(secret_id=args.secret_id, region_name=args.region, host=args.db_host,
                               dbname=args.db_name)
    env = dict(os.environ)
    if resolved is not None:
        env[secrets.ENV_STORAGE] = resolved.url
    sys.stdout.flush()
    try:
        os.execvpe(command[0], command, env)
    except OSError as e:
        raise InfraError(f"with-db: cannot run {command[0]!r}: {e.strerror}") from None
    return 0  # pragma: no cover - execvpe does not return


def cmd_capacity(args: argparse.Namespace) -> int:

    region = _region(args)
    need = capacity.parse_need(args.need or ["trn2.3xlarge=1"])
    report = capacity.check(aws.client("ec2", region), aws.client("service-quotas", region), region, need,
                            spot=args.spot, head_type=None if args.no_head else args.head_type)
    _emit(args, report.as_dict(), report.lines())
    return 0 if report.ok else 1


def cmd_cost(args: argparse.Namespace) -> int:

    spec = cost.load_spec(args.spec)
    price, source = args.price_usd_per_hour, None
    if args.live_price:
        region = _region(args)
        args.instance_type = args.instance_type or cost.instance_for(cost.chips_per_trial(spec))
        price = cost.live_price(aws.client("pricing", "us-east-1"), args.instance_type, region)
        source = f"AWS Price List API, {region}, on-demand Linux"
    est = cost.estimate(spec, instance_type=args.instance_type, price_usd_per_hour=price, price_source=source,
                        parallel=args.parallel, head_type=args.head_type,
                        head_price_usd_per_hour=args.head_price_usd_per_hour, cap_usd=args.cap_usd)
    if not args.check:
        _emit(args, est.as_dict(), est.lines())
    cost.enforce(est)
    return 0


def cmd_security_group(args: argparse.Namespace) -> int:

    out = network.ensure(aws.client("ec2", _region(args)), args.cluster_name, args.ssh_cidr, vpc_id=args.vpc_id)
    lines = [f"security group {out['group_name']} ({out['group_id']}) in {out['vpc_id']}: "
             f"{'created' if out['created'] else 'exists'}; SSH from {', '.join(out['ssh_from'])}, "
             "all traffic between members, nothing else"]
    if out["warning"]:
        lines.append(f"warning: {out['warning']}")
    _emit(args, out, lines)
    return 0


def cmd_iam(args: argparse.Namespace) -> int:

    region = _region(args)
    client = aws.client("iam", region)
    if args.delete:
        gone = iam.delete(client)
        print("deleted: " + (", ".join(gone) if gone else "nothing (none existed)"))
        return 0
    bucket = args.bucket or _default_bucket(region)
    secret = None
    if args.db_secret:
        secret = iam.secret_arn(aws.client("secretsmanager", region), args.db_secret)
    out = iam.ensure(client, bucket, secret)
    _emit(args, out, [f"instance profiles {out['head_profile']} (head) and {out['worker_profile']} (workers): ready",
                      f"  bucket {bucket}; database secret {args.db_secret or '(none: head PostgreSQL)'}"])
    return 0


def cmd_sync(args: argparse.Namespace) -> int:

    remote = args.src if args.src.startswith("s3://") else args.dst
    bucket = sync.parse_s3(remote).bucket
    region = args.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    direction, n = sync.sync(aws.client("s3", region), args.src, args.dst, min_age_s=args.min_age_s)
    if not args.quiet:
        print(f"sync {direction} {args.src} -> {args.dst}: {n} file(s) (bucket {bucket})")
    return 0


def cmd_scale(args: argparse.Namespace) -> int:

    cores = scale.cores_per_worker(args.type, args.lnc)
    wanted = scale.request(args.workers, cores)
    if wanted:
        print(f"requested {len(wanted)} x {args.type} ({cores} neuron_cores each) from the autoscaler; "
              "withdraw with --workers 0 when the sweep ends")
    else:
        print("standing request withdrawn: idle workers will be scaled away")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    """Preflight: credentials, bucket, database secret, capacity; every problem listed, exit 1 if any."""

    region = _region(args)
    problems: list[str] = []
    lines = [f"account {aws.account_id(region)}, region {region}"]
    name = args.bucket or _default_bucket(region)
    s3 = aws.client("s3", region)
    try:
        if buckets.exists(s3, name):
            info = buckets.describe(s3, name)
            lines.append(f"bucket {name}: {info['region']}, public access blocked {info['public_access_blocked']}, "
                         f"encryption {info['encryption']}")
            if info["region"] != region or not info["public_access_blocked"]:
                problems.append(f"bucket {name}: rerun `python -m infra bucket --name {name}`")
        else:
            problems.append(f"bucket {name} does not exist: python -m infra bucket --name {name}")
    except InfraError as e:
        problems.append(str(e))
    if args.db_secret:
        try:
            resolved = secrets.resolve(env={}, secret_id=args.db_secret, region_name=region)
            lines.append(f"database {secrets.redact(resolved.url) if resolved else '?'} (from {args.db_secret})")
        except InfraError as e:
            problems.append(str(e))
    report = capacity.check(aws.client("ec2", region), aws.client("service-quotas", region), region,
                            capacity.parse_need(args.need or ["trn2.3xlarge=1"]), spot=args.spot,
                            head_type=args.head_type)
    lines.extend(report.lines()[1:-1])
    problems.extend(report.missing)
    lines = [ln for ln in lines if not ln.startswith("missing: ")]
    lines.extend(f"problem: {p}" for p in problems)
    lines.append("preflight: ok" if not problems else f"preflight: {len(problems)} problem(s)")
    print("\n".join(lines))
    return 0 if not problems else 1


# -- parser ---------------------------------------------------------------------------------------

def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _money(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:

    p = _Parser(prog="python -m infra", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def add(name: str, fn: Any, help_text: str, region: bool = True,
            json_flag: bool = False) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_text, description=help_text)
        sp.set_defaults(fn=fn)
        if region:
            sp.add_argument("--region", help="AWS region (default: AWS_REGION / AWS_DEFAULT_REGION / profile)")
        if json_flag:
            sp.add_argument("--json", action="store_true", help="print one JSON object")
        return sp

    sp = add("ami", cmd_ami, "print the Neuron DLAMI id from its public SSM parameter, checked against the pinned "
             "Neuron SDK (an older image of that SDK where `latest` has moved on)")
    sp.add_argument("--ssm-parameter", default=ami.DEFAULT_SSM_PARAMETER, help=f"default {ami.DEFAULT_SSM_PARAMETER}")

    sp = add("render-cluster", cmd_render, "render infra/ray/trn2.yaml into runs/aws/CLUSTER/cluster.yaml",
             json_flag=True)
    sp.add_argument("--cluster-name", default="trnsweep")
    sp.add_argument("--ami", help="AMI id to use instead of resolving --ssm-parameter (or of the competition image)")
    sp.add_argument("--profile", choices=environment.PROFILES, default=environment.COMPETITION,
                    help=f"competition (default): the kit's image {environment.COMPETITION_AMI} and its venv, "
                         "untouched; latest-sdk: the pinned TorchNeuron DLAMI with our pins")
    sp.add_argument("--image-venv", default=environment.COMPETITION_VENV,
                    help=f"competition: the image venv's name or path (default {environment.COMPETITION_VENV})")
    sp.add_argument("--ssm-parameter", default=ami.DEFAULT_SSM_PARAMETER)
    sp.add_argument("--zones", default="auto", help="comma-separated zones, or 'auto': the zones offering the types")
    sp.add_argument("--bucket", help="artifact and compile-cache bucket (default trnsweep-ACCOUNT-REGION)")
    sp.add_argument("--head-type", default="m7i.2xlarge")
    sp.add_argument("--lnc", type=int, choices=(1, 2), default=2,
                    help="logical NeuronCore config: 2 -> 4 neuron_cores per chip (default), 1 -> 8")
    sp.add_argument("--spot", action="store_true", help="trn2 workers on spot (a reclaimed trial is retried once)")
    sp.add_argument("--max-3xl", type=_positive_int, default=8, help="most trn2.3xlarge workers (default 8)")
    sp.add_argument("--max-48xl", type=_positive_int, default=0, help="most trn2.48xlarge workers (default 0)")
    sp.add_argument("--db", choices=("head", "secret"), default="head",
                    help="head: PostgreSQL on the head node; secret: --db-secret names an RDS/external one")
    sp.add_argument("--db-secret", help="Secrets Manager id or ARN of the database credentials")
    sp.add_argument("--db-host", help="database host, when the secret has none (RDS-managed secrets)")
    sp.add_argument("--db-name", help="database name, when the secret has none")
    sp.add_argument("--torch-pin", help="default: the Makefile's TORCH_PIN")
    sp.add_argument("--auth-token", default="~/.ray/auth_token", help="Ray auth token file copied to every node")
    sp.add_argument("--out-dir", help="default runs/aws/CLUSTER")

    sp = add("bucket", cmd_bucket, "create or find the artifact and compile-cache bucket (private, encrypted)",
             json_flag=True)
    sp.add_argument("--name", help="default trnsweep-ACCOUNT-REGION")
    sp.add_argument("--kms-key-id", help="encrypt with this KMS key instead of SSE-S3")

    sp = add("bucket-delete", cmd_bucket_delete, "delete every object version and the bucket")
    sp.add_argument("name")
    sp.add_argument("--yes", action="store_true", help="confirm")

    for name, fn, text in (("db-url", cmd_db_url, "print the study database URL, password redacted"),
                           ("with-db", cmd_with_db, "run a command with SWEEP_STORAGE set from the secret")):
        sp = add(name, fn, text)
        sp.add_argument("--secret-id", help="Secrets Manager id/ARN or file:PATH (default $SWEEP_DB_SECRET)")
        sp.add_argument("--db-host", help="host when the secret has none (default $SWEEP_DB_HOST)")
        sp.add_argument("--db-name", help="database when the secret has none (default $SWEEP_DB_NAME or postgres)")
        if name == "db-url":
            sp.add_argument("--check", action="store_true", help="also connect and report the server version")
        else:
            sp.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")

    sp = add("capacity", cmd_capacity, "check trn2 offerings and vCPU quotas before a sweep", json_flag=True)
    sp.add_argument("--need", action="append", metavar="TYPE=COUNT",
                    help="workers the sweep may run at once (repeatable; default trn2.3xlarge=1)")
    sp.add_argument("--spot", action="store_true", help="check the spot quota for the workers")
    sp.add_argument("--head-type", default="m7i.2xlarge")
    sp.add_argument("--no-head", action="store_true", help="the head already runs; do not count it")

    sp = add("cost", cmd_cost, "estimate a study's chip-hours and dollars; exit 2 past its cost cap", json_flag=True)
    sp.add_argument("spec", help="study name (sweep/studies/NAME.toml) or path to a .toml")
    sp.add_argument("--cap-usd", type=_money, help="cost cap (else the spec's study.cost_cap_usd, if any)")
    sp.add_argument("--instance-type", default=None, choices=("trn2.3xlarge", "trn2.48xlarge"),
                    help="default: the smallest that holds one trial")
    sp.add_argument("--price-usd-per-hour", type=_money, help="instance price (default: built-in table)")
    sp.add_argument("--live-price", action="store_true", help="ask the AWS Price List API for the price")
    sp.add_argument("--parallel", type=_positive_int, help="trials at once, to count the head (default: spec)")
    sp.add_argument("--head-type", default="m7i.2xlarge")
    sp.add_argument("--head-price-usd-per-hour", type=_money)
    sp.add_argument("--check", action="store_true", help="print nothing unless the cap is exceeded")

    sp = add("security-group", cmd_security_group, "create the cluster's security group: SSH from your CIDR only",
             json_flag=True)
    sp.add_argument("--cluster-name", default="trnsweep")
    sp.add_argument("--ssh-cidr", action="append", required=True, help="e.g. 203.0.113.7/32 (repeatable)")
    sp.add_argument("--vpc-id", help="default: the region's default VPC")

    sp = add("iam", cmd_iam, "create the head and worker instance profiles (or --delete them)", json_flag=True)
    sp.add_argument("--bucket", help="default trnsweep-ACCOUNT-REGION")
    sp.add_argument("--db-secret", help="Secrets Manager id the head may read (RDS or external database)")
    sp.add_argument("--delete", action="store_true")

    sp = add("sync", cmd_sync, "copy new files between a directory and s3:// (one way, no deletes)")
    sp.add_argument("src")
    sp.add_argument("dst")
    sp.add_argument("--min-age-s", type=float, default=300.0,
                    help="push only files unchanged this long (default 300; a compile may still be writing)")
    sp.add_argument("--quiet", action="store_true")

    sp = add("scale", cmd_scale, "ask the autoscaler for N trn2 workers now (on the head; 0 withdraws)",
             region=False)
    sp.add_argument("--workers", type=_positive_int, required=True)
    sp.add_argument("--type", default="trn2.3xlarge", choices=("trn2.3xlarge", "trn2.48xlarge"))
    sp.add_argument("--lnc", type=int, choices=(1, 2), help="default: $NEURON_LOGICAL_NC_CONFIG or 2")

    sp = add("check", cmd_check, "preflight: credentials, bucket, database secret, capacity")
    sp.add_argument("--bucket")
    sp.add_argument("--db-secret")
    sp.add_argument("--need", action="append", metavar="TYPE=COUNT")
    sp.add_argument("--spot", action="store_true")
    sp.add_argument("--head-type", default="m7i.2xlarge")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return int(args.fn(args))
    except InfraError as e:
        print(f"infra: {_scrub(str(e))}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print("infra: interrupted", file=sys.stderr)
        return 130


def _scrub(text: str) -> str:
    """Last line of defence: a message never carries the password of the URL in force."""
    return scrub(text, os.environ.get("SWEEP_STORAGE"))

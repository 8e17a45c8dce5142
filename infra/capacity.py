"""Before a sweep: can this account start the trn2 nodes it needs in this region?

Three things must hold, and each is checked and reported separately so the message says what to fix:

1. the instance types are offered in some availability zone of the region
   (EC2 DescribeInstanceTypeOfferings; trn2 exists in few regions and zones);
2. the account's vCPU quota for the family covers what is already running plus what the sweep adds
   (Service Quotas; new accounts start at 0 vCPU for Trn, so this is the usual blocker);
3. the head node's family (standard instances) has room too.

Offerings say where AWS sells a type, not that a machine is free right now: trn2 capacity can still
run out (then the Ray autoscaler retries and tries the next zone); EC2 Capacity Blocks or On-Demand
Capacity Reservations guarantee it, and active ones are listed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from infra.aws import BadInput, call, error_code, translate

# vCPUs per instance, used when DescribeInstanceTypes is unavailable (AWS instance type specs).
VCPUS = {"trn2.3xlarge": 12, "trn2.48xlarge": 192, "m7i.xlarge": 4, "m7i.2xlarge": 8, "m7i.4xlarge": 16}
CHIPS = {"trn2.3xlarge": 1, "trn2.48xlarge": 16}

# EC2 vCPU quotas by instance family and purchase option (Service Quotas, service code "ec2").
QUOTAS: dict[tuple[str, str], tuple[str, str]] = {
    ("trn", "on-demand"): ("L-2C3B7624", "Running On-Demand Trn instances"),
    ("trn", "spot"): ("L-6B0D517C", "All Trn Spot Instance Requests"),
    ("standard", "on-demand"): ("L-1216C47A", "Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances"),
    ("standard", "spot"): ("L-34B43A08", "All Standard (A, C, D, H, I, M, R, T, Z) Spot Instance Requests"),
}
_STANDARD_LETTERS = set("acdhimrtz")


def family(instance_type: str) -> str:
    """The quota family of an instance type ('trn' or 'standard'); other families are not checked."""
    prefix = instance_type.split(".", 1)[0]
    if prefix.startswith("trn"):
        return "trn"
    if prefix and prefix[0] in _STANDARD_LETTERS:
        return "standard"
    raise BadInput(f"instance type {instance_type!r}: only trn* and standard (A, C, D, H, I, M, R, T, Z) families "
                   "are checked")


def parse_need(items: list[str]) -> dict[str, int]:
    """``TYPE=COUNT`` pairs (``trn2.3xlarge=8``) into a dict; counts must be positive integers."""
    need: dict[str, int] = {}
    for item in items:
        name, sep, count = item.partition("=")
        if not sep or "." not in name or not count.isdigit() or int(count) < 1:
            raise BadInput(f"--need {item!r}: expected TYPE=COUNT, e.g. trn2.3xlarge=8")
        need[name] = need.get(name, 0) + int(count)
    return need


def offered_zones(ec2: Any, types: list[str]) -> dict[str, list[str]]:
    """Availability zones (names) of the client's region that offer each type."""
    zones: dict[str, list[str]] = {t: [] for t in types}
    paginator = ec2.get_paginator("describe_instance_type_offerings")
    pages = call("EC2 DescribeInstanceTypeOfferings", lambda: list(paginator.paginate(
        LocationType="availability-zone", Filters=[{"Name": "instance-type", "Values": types}])))
    for page in pages:
        for offer in page.get("InstanceTypeOfferings", []):
            zones.setdefault(offer["InstanceType"], []).append(offer["Location"])
    return {t: sorted(set(z)) for t, z in zones.items()}


def vcpus_per_instance(ec2: Any, types: list[str]) -> dict[str, int]:
    """vCPUs per instance from EC2, falling back to the table for types EC2 does not describe here."""
    found: dict[str, int] = {}
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        for page in ec2.get_paginator("describe_instance_types").paginate(InstanceTypes=types):
            for it in page.get("InstanceTypes", []):
                found[it["InstanceType"]] = int(it["VCpuInfo"]["DefaultVCpus"])
    except (ClientError, BotoCoreError):
        pass  # a type unknown in this region: the offerings check reports it
    for t in types:
        if t not in found and t in VCPUS:
            found[t] = VCPUS[t]
    return found


def quota_value(sq: Any, code: str) -> float | None:
    """The applied quota (vCPUs), else AWS's default; None when Service Quotas knows neither."""
    from botocore.exceptions import BotoCoreError, ClientError

    for method in (sq.get_service_quota, sq.get_aws_default_service_quota):
        try:
            return float(method(ServiceCode="ec2", QuotaCode=code)["Quota"]["Value"])
        except ClientError as e:
            if error_code(e) != "NoSuchResourceException":
                raise translate(e, f"Service Quotas {code}") from None
        except BotoCoreError as e:
            raise translate(e, f"Service Quotas {code}") from None
    return None


def vcpus_in_use(ec2: Any, fam: str, market: str, sizes: Mapping[str, int]) -> int:
    """vCPUs of this account's pending/running instances of a family and purchase option."""
    used = 0
    paginator = ec2.get_paginator("describe_instances")
    pages = call("EC2 DescribeInstances", lambda: list(paginator.paginate(
        Filters=[{"Name": "instance-state-name", "Values": ["pending", "running"]}])))
    for page in pages:
        for reservation in page.get("Reservations", []):
            for inst in reservation.get("Instances", []):
                itype = inst["InstanceType"]
                try:
                    if family(itype) != fam:
                        continue
                except BadInput:
                    continue
                is_spot = inst.get("InstanceLifecycle") == "spot"
                if is_spot != (market == "spot"):
                    continue
                cpu = inst.get("CpuOptions", {})
                vcpus = cpu.get("CoreCount", 0) * cpu.get("ThreadsPerCore", 0) or sizes.get(itype, VCPUS.get(itype, 0))
                used += vcpus
    return used


def reservations(ec2: Any, types: list[str]) -> list[dict[str, Any]]:
    """Active capacity reservations (incl. Capacity Blocks) for these types; empty if none or not allowed."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        out = ec2.describe_capacity_reservations(Filters=[
            {"Name": "instance-type", "Values": types}, {"Name": "state", "Values": ["active"]}])
    except (ClientError, BotoCoreError):
        return []
    return [{"type": r["InstanceType"], "zone": r.get("AvailabilityZone"), "available": r.get("AvailableInstanceCount"),
             "total": r.get("TotalInstanceCount"), "id": r.get("CapacityReservationId")}
            for r in out.get("CapacityReservations", [])]


@dataclass
class Report:
    """What was found and what is missing; ``ok`` when nothing is."""

    region: str
    zones: dict[str, list[str]] = field(default_factory=dict)
    quotas: list[dict[str, Any]] = field(default_factory=list)
    reservations: list[dict[str, Any]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.missing

    def lines(self) -> list[str]:
        out = [f"region {self.region}"]
        for t, zones in self.zones.items():
            out.append(f"  {t}: offered in {', '.join(zones)}" if zones else f"  {t}: NOT offered in this region")
        for q in self.quotas:
            limit = "unknown" if q["limit"] is None else f"{q['limit']:g}"
            out.append(f"  quota {q['name']} ({q['code']}): {limit} vCPU, in use {q['in_use']}, "
                       f"sweep adds {q['need']} -> {'ok' if q['ok'] else 'SHORT'}")
        for r in self.reservations:
            out.append(f"  reservation {r['id']}: {r['type']} in {r['zone']}, {r['available']}/{r['total']} free")
        out.extend(f"missing: {m}" for m in self.missing)
        out.append("capacity: ok" if self.ok else f"capacity: {len(self.missing)} problem(s), see 'missing' above")
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"region": self.region, "ok": self.ok, "zones": self.zones, "quotas": self.quotas,
                "reservations": self.reservations, "missing": self.missing}


def check(ec2: Any, sq: Any, region_name: str, need: Mapping[str, int], spot: bool = False,
          head_type: str | None = "m7i.2xlarge") -> Report:
    """Offerings, quotas and reservations for ``need`` workers (plus the head) in one report."""
    if not need:
        raise BadInput("nothing to check: pass --need TYPE=COUNT")
    types = sorted(need)
    all_types = types + ([head_type] if head_type and head_type not in need else [])
    for t in all_types:
        family(t)  # reject unchecked families before any call
    report = Report(region=region_name)
    report.zones = offered_zones(ec2, all_types)
    for t in all_types:
        if not report.zones.get(t):
            report.missing.append(f"{t} is not offered in {region_name}: choose a region where it is "
                                  "(aws ec2 describe-instance-type-offerings --filters Name=instance-type,Values="
                                  f"{t} --region REGION)")
    sizes = vcpus_per_instance(ec2, all_types)
    demand: dict[tuple[str, str], int] = {}
    for t, count in need.items():
        key = (family(t), "spot" if spot else "on-demand")
        demand[key] = demand.get(key, 0) + count * sizes.get(t, 0)
    if head_type:
        key = (family(head_type), "on-demand")  # the head is always on-demand: losing it loses the sweep
        demand[key] = demand.get(key, 0) + (0 if head_type in need else sizes.get(head_type, 0))
    for (fam, market), vcpus in sorted(demand.items()):
        code, name = QUOTAS[(fam, market)]
        limit = quota_value(sq, code)
        in_use = vcpus_in_use(ec2, fam, market, sizes)
        ok = limit is not None and in_use + vcpus <= limit
        report.quotas.append({"code": code, "name": name, "limit": limit, "in_use": in_use, "need": vcpus, "ok": ok})
        if limit is None:
            report.missing.append(f"quota {name} ({code}) is unknown to Service Quotas in {region_name}")
        elif not ok:
            wanted = math.ceil(in_use + vcpus)
            report.missing.append(
                f"quota {name} is {limit:g} vCPU but {in_use} are in use and the sweep adds {vcpus}: request "
                f"{wanted} (aws service-quotas request-service-quota-increase --service-code ec2 --quota-code {code} "
                f"--desired-value {wanted} --region {region_name})")
    report.reservations = reservations(ec2, types)
    return report


def zones_offering(ec2: Any, types: list[str]) -> list[str]:
    """Zones offering every type in ``types`` (for the cluster's availability_zone list)."""
    offered = offered_zones(ec2, types)
    common = set.intersection(*(set(z) for z in offered.values())) if offered else set()
    if not common:
        where = "; ".join(f"{t}: {', '.join(z) or 'nowhere'}" for t, z in offered.items())
        raise BadInput(f"no zone of {ec2.meta.region_name} offers all of {', '.join(types)} ({where})")
    return sorted(common)

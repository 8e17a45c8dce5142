"""Capacity and quota checks with botocore's Stubber (moto has no Service Quotas for EC2 and no trn2.3xlarge).

Every AWS answer is scripted; the tests pin what the report says is missing and how.
"""

from __future__ import annotations

import boto3
import pytest
from botocore.stub import ANY, Stubber

from infra import capacity
from infra.aws import BadInput

REGION = "us-east-2"


def clients():
    kw = {"region_name": REGION, "aws_access_key_id": "x", "aws_secret_access_key": "x"}
    return boto3.client("ec2", **kw), boto3.client("service-quotas", **kw)


def offerings(pairs):
    return {"InstanceTypeOfferings": [{"InstanceType": t, "LocationType": "availability-zone", "Location": z}
                                      for t, z in pairs]}


def types(*pairs):
    return {"InstanceTypes": [{"InstanceType": t, "VCpuInfo": {"DefaultVCpus": v}} for t, v in pairs]}


def quota(code, value):
    return {"Quota": {"ServiceCode": "ec2", "QuotaCode": code, "Value": value}}


def instances(*items):
    return {"Reservations": [{"Instances": [
        {"InstanceType": t, **({"InstanceLifecycle": "spot"} if spot else {}),
         "CpuOptions": {"CoreCount": v // 2, "ThreadsPerCore": 2}} for t, v, spot in items]}]}


def script(ec2_stub, sq_stub, *, offered, vcpus, quotas, running=(), reservations=None):
    """The calls ``capacity.check`` makes, in order, with the given answers."""
    ec2_stub.add_response("describe_instance_type_offerings", offerings(offered),
                          {"LocationType": "availability-zone", "Filters": ANY})
    ec2_stub.add_response("describe_instance_types", types(*vcpus), {"InstanceTypes": ANY})
    for code, value in quotas:
        if value is None:
            sq_stub.add_client_error("get_service_quota", service_error_code="NoSuchResourceException")
            sq_stub.add_client_error("get_aws_default_service_quota", service_error_code="NoSuchResourceException")
        else:
            sq_stub.add_response("get_service_quota", quota(code, value), {"ServiceCode": "ec2", "QuotaCode": code})
        ec2_stub.add_response("describe_instances", instances(*running), {"Filters": ANY})
    if reservations is None:
        ec2_stub.add_client_error("describe_capacity_reservations", service_error_code="UnauthorizedOperation")
    else:
        ec2_stub.add_response("describe_capacity_reservations", {"CapacityReservations": reservations},
                              {"Filters": ANY})


def test_all_good_with_reservation():
    ec2, sq = clients()
    with Stubber(ec2) as es, Stubber(sq) as ss:
        script(es, ss, offered=[("trn2.3xlarge", "us-east-2a"), ("trn2.3xlarge", "us-east-2b"),
                                ("m7i.2xlarge", "us-east-2a")],
               vcpus=[("trn2.3xlarge", 12), ("m7i.2xlarge", 8)],
               quotas=[("L-1216C47A", 64.0), ("L-2C3B7624", 96.0)],
               reservations=[{"InstanceType": "trn2.3xlarge", "AvailabilityZone": "us-east-2a",
                              "AvailableInstanceCount": 2, "TotalInstanceCount": 4,
                              "CapacityReservationId": "cr-1"}])
        report = capacity.check(ec2, sq, REGION, {"trn2.3xlarge": 8})
    assert report.ok, report.missing
    assert report.zones == {"trn2.3xlarge": ["us-east-2a", "us-east-2b"], "m7i.2xlarge": ["us-east-2a"]}
    trn = next(q for q in report.quotas if q["code"] == "L-2C3B7624")
    assert trn == {"code": "L-2C3B7624", "name": "Running On-Demand Trn instances", "limit": 96.0, "in_use": 0,
                   "need": 96, "ok": True}
    text = "\n".join(report.lines())
    assert "reservation cr-1: trn2.3xlarge in us-east-2a, 2/4 free" in text and text.endswith("capacity: ok")


def test_zero_trn_quota_and_unoffered_type_are_spelled_out():
    ec2, sq = clients()
    with Stubber(ec2) as es, Stubber(sq) as ss:
        script(es, ss, offered=[("trn2.3xlarge", "us-east-2c"), ("m7i.2xlarge", "us-east-2c")],
               vcpus=[("trn2.3xlarge", 12), ("m7i.2xlarge", 8)],
               quotas=[("L-1216C47A", 32.0), ("L-2C3B7624", 0.0)])
        report = capacity.check(ec2, sq, REGION, {"trn2.3xlarge": 2, "trn2.48xlarge": 1})
    assert not report.ok
    joined = "\n".join(report.missing)
    assert "trn2.48xlarge is not offered in us-east-2" in joined
    # 2 x 12 + 1 x 192 (table fallback: EC2 did not describe trn2.48xlarge) = 216 vCPU on a 0 quota.
    assert ("quota Running On-Demand Trn instances is 0 vCPU but 0 are in use and the sweep adds 216: request 216 "
            "(aws service-quotas request-service-quota-increase --service-code ec2 --quota-code L-2C3B7624 "
            "--desired-value 216 --region us-east-2)") in joined
    assert report.lines()[-1] == "capacity: 2 problem(s), see 'missing' above"


def test_running_instances_count_against_the_quota_and_spot_is_separate():
    ec2, sq = clients()
    with Stubber(ec2) as es, Stubber(sq) as ss:
        script(es, ss, offered=[("trn2.3xlarge", "us-east-2a")], vcpus=[("trn2.3xlarge", 12)],
               quotas=[("L-6B0D517C", 48.0)],
               running=[("trn2.3xlarge", 12, True), ("trn2.3xlarge", 12, True), ("trn2.3xlarge", 12, False),
                        ("m7i.2xlarge", 8, False)])
        report = capacity.check(ec2, sq, REGION, {"trn2.3xlarge": 3}, spot=True, head_type=None)
    (q,) = report.quotas
    assert q["name"] == "All Trn Spot Instance Requests" and q["in_use"] == 24 and q["need"] == 36 and not q["ok"]
    assert "request 60" in report.missing[0]


def test_quota_unknown_to_service_quotas():
    ec2, sq = clients()
    with Stubber(ec2) as es, Stubber(sq) as ss:
        script(es, ss, offered=[("trn2.3xlarge", "us-east-2a")], vcpus=[("trn2.3xlarge", 12)],
               quotas=[("L-2C3B7624", None)])
        report = capacity.check(ec2, sq, REGION, {"trn2.3xlarge": 1}, head_type=None)
    assert report.missing == ["quota Running On-Demand Trn instances (L-2C3B7624) is unknown to Service Quotas in "
                              "us-east-2"]
    assert report.as_dict()["ok"] is False


def test_default_quota_used_when_never_changed():
    _, sq = clients()
    with Stubber(sq) as ss:
        ss.add_client_error("get_service_quota", service_error_code="NoSuchResourceException")
        ss.add_response("get_aws_default_service_quota", quota("L-2C3B7624", 0.0))
        assert capacity.quota_value(sq, "L-2C3B7624") == 0.0


def test_zones_offering_every_type():
    ec2, _ = clients()
    with Stubber(ec2) as es:
        es.add_response("describe_instance_type_offerings", offerings([
            ("trn2.3xlarge", "us-east-2a"), ("trn2.3xlarge", "us-east-2b"), ("m7i.2xlarge", "us-east-2b")]))
        assert capacity.zones_offering(ec2, ["trn2.3xlarge", "m7i.2xlarge"]) == ["us-east-2b"]
        es.add_response("describe_instance_type_offerings", offerings([("m7i.2xlarge", "us-east-2b")]))
        with pytest.raises(BadInput, match="trn2.3xlarge: nowhere"):
            capacity.zones_offering(ec2, ["trn2.3xlarge", "m7i.2xlarge"])


@pytest.mark.parametrize("items, message", [
    (["trn2.3xlarge"], "expected TYPE=COUNT"), (["trn2.3xlarge=0"], "expected TYPE=COUNT"),
    (["trn2=4"], "expected TYPE=COUNT"), (["trn2.3xlarge=x"], "expected TYPE=COUNT"),
])
def test_need_parsing(items, message):
    with pytest.raises(BadInput, match=message):
        capacity.parse_need(items)


def test_need_and_families():
    assert capacity.parse_need(["trn2.3xlarge=2", "trn2.3xlarge=3", "trn2.48xlarge=1"]) == {
        "trn2.3xlarge": 5, "trn2.48xlarge": 1}
    assert capacity.family("trn2.48xlarge") == "trn" and capacity.family("m7i.2xlarge") == "standard"
    with pytest.raises(BadInput, match="only trn"):
        capacity.family("p5.48xlarge")

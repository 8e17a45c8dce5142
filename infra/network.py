"""The cluster's security group: SSH from your address, all traffic between cluster nodes, nothing else.

Ray's launcher looks up the group named in ``provider.security_group.GroupName`` and only adds its
own rules (SSH from 0.0.0.0/0 plus intra-cluster) to a group that has none. Creating the group
first, with SSH limited to your CIDR, therefore keeps SSH closed to the rest of the internet;
dashboards (Ray 8265, optuna-dashboard 8080) listen on the head's loopback and are reached through
an SSH tunnel, and PostgreSQL on the head is reachable only from cluster members.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from infra.aws import BadInput, call


def group_name(cluster: str) -> str:
    """The security group's name, shared with the cluster config (``provider.security_group``)."""
    return cluster if cluster.startswith("trnsweep") else f"trnsweep-{cluster}"


def check_cidr(text: str) -> str:
    try:
        net = ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise BadInput(f"--ssh-cidr {text!r}: not an IPv4/IPv6 network (e.g. 203.0.113.7/32)") from None
    return str(net)


def default_vpc(ec2: Any) -> str:
    vpcs = call("EC2 DescribeVpcs", ec2.describe_vpcs, Filters=[{"Name": "is-default", "Values": ["true"]}])["Vpcs"]
    if not vpcs:
        raise BadInput(f"no default VPC in {ec2.meta.region_name}: pass --vpc-id")
    return str(vpcs[0]["VpcId"])


def _missing_rules(group_id: str, cidrs: list[str], have: set[tuple[str, Any, str]]) -> list[dict[str, Any]]:
    """SSH from each CIDR and all traffic from the group itself, minus what the group already allows."""
    rules: list[dict[str, Any]] = []
    v4 = [{"CidrIp": c, "Description": "SSH"} for c in cidrs if ":" not in c and ("tcp", 22, c) not in have]
    v6 = [{"CidrIpv6": c, "Description": "SSH"} for c in cidrs if ":" in c and ("tcp", 22, c) not in have]
    if v4 or v6:
        ssh: dict[str, Any] = {"IpProtocol": "tcp", "FromPort": 22, "ToPort": 22}
        if v4:
            ssh["IpRanges"] = v4
        if v6:
            ssh["Ipv6Ranges"] = v6
        rules.append(ssh)
    if ("-1", None, group_id) not in have:
        rules.append({"IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": group_id, "Description": "cluster nodes"}]})
    return rules


def ensure(ec2: Any, cluster: str, ssh_cidrs: list[str], vpc_id: str | None = None) -> dict[str, Any]:
    """Create the group (or add missing rules to it); returns its id, VPC and open ports."""
    if not ssh_cidrs:
        raise BadInput("pass at least one --ssh-cidr (your address, e.g. $(curl -s https://checkip.amazonaws.com)/32)")
    cidrs = [check_cidr(c) for c in ssh_cidrs]
    vpc = vpc_id or default_vpc(ec2)
    name = group_name(cluster)
    found = call("EC2 DescribeSecurityGroups", ec2.describe_security_groups, Filters=[
        {"Name": "vpc-id", "Values": [vpc]}, {"Name": "group-name", "Values": [name]}])["SecurityGroups"]
    if found:
        group = found[0]
        created = False
    else:
        group_id = call(f"create security group {name}", ec2.create_security_group, GroupName=name, VpcId=vpc,
                        Description="trnsweep Ray cluster: SSH from the operator, all traffic between nodes",
                        TagSpecifications=[{"ResourceType": "security-group", "Tags": [
                            {"Key": "project", "Value": "trnsweep"}, {"Key": "ray-cluster-name", "Value": cluster}]}],
                        )["GroupId"]
        group = {"GroupId": group_id, "IpPermissions": []}
        created = True
    group_id = str(group["GroupId"])
    wanted = _missing_rules(group_id, cidrs, _existing(group.get("IpPermissions", [])))
    if wanted:
        call(f"security group {name}: add rules", ec2.authorize_security_group_ingress, GroupId=group_id,
             IpPermissions=wanted)
    world = [c for c in cidrs if c in ("0.0.0.0/0", "::/0")]
    return {"group_id": group_id, "group_name": name, "vpc_id": vpc, "created": created,
            "ssh_from": cidrs, "warning": "SSH is open to the whole internet" if world else None}


def _existing(perms: list[dict[str, Any]]) -> set[tuple[str, Any, str]]:
    have: set[tuple[str, Any, str]] = set()
    for p in perms:
        proto = str(p.get("IpProtocol"))
        port = None if proto == "-1" else p.get("FromPort")
        have.update((proto, port, r["CidrIp"]) for r in p.get("IpRanges", []))
        have.update((proto, port, r["CidrIpv6"]) for r in p.get("Ipv6Ranges", []))
        have.update((proto, port, g["GroupId"]) for g in p.get("UserIdGroupPairs", []))
    return have

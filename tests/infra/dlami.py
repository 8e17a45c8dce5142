"""Neuron DLAMIs as AWS publishes them, inside moto: Amazon-owned images with the SDK in the description."""

from __future__ import annotations

import os
from typing import Any

import pytest

OWNER = "898082745236"  # any account id: moto marks every image it loads this way as owned by "amazon"


def image(ami_id: str, sdk: str, name: str = "Deep Learning AMI Neuron torch-neuronx 2.14.0 (Ubuntu 24.04)",
          day: str = "20261020") -> dict[str, Any]:
    """One DLAMI: "<name> <day>", its description naming the Neuron SDK release (the DLAMI guide's rule)."""
    return {"ami_id": ami_id, "name": f"{name} {day}", "owner_id": OWNER, "public": True, "state": "available",
            "description": f"{name} {day}: supported EC2 instances Trn2, Trn3. Neuron SDK {sdk}",
            "creation_date": f"{day[:4]}-{day[4:6]}-{day[6:]}T00:00:00.000Z", "architecture": "x86_64",
            "virtualization_type": "hvm", "root_device_type": "ebs", "image_type": "machine"}


def publish(monkeypatch: pytest.MonkeyPatch, *images: dict[str, Any]) -> None:
    """Make these the region's public Amazon images; call inside moto before the first EC2 request."""
    from moto.ec2.models import amis

    monkeypatch.setattr(amis, "AMIS", [dict(i) for i in images])
    monkeypatch.setenv("MOTO_AMIS_PATH", os.devnull)  # moto then loads AMIS alone, not its own region lists

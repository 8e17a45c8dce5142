"""The TorchNeuron Deep Learning AMI, looked up through AWS's public SSM parameters.

Native TorchNeuron (the ``neuron`` device) ships on the "Deep Learning AMI Neuron torch-neuronx 2.14.0"
DLAMI, in its own venv (sweep/neuron/versions.py names both); the multi-framework DLAMI has no PyTorch
venv since Neuron 2.32. AWS publishes each DLAMI's latest id per region under
``/aws/service/neuron/dlami/<framework>-<version>/<os>/latest/image_id`` (Neuron DLAMI user guide).
No page lists this DLAMI's exact prefix, so the default is the documented pattern filled in (a guess)
and, where that parameter does not exist, :func:`resolve` lists ``/aws/service/neuron/dlami`` and takes
the TorchNeuron 2.14 Ubuntu 24.04 entry it finds there.

The Ray launcher cannot read SSM itself, so ``python -m infra render-cluster`` resolves the id once and
writes it into the cluster config: every node the autoscaler starts later, hours into a sweep, then
boots the same image (and the same Neuron runtime) as the first, even if AWS publishes a new one.

``latest`` follows AWS's newest release, while sweep/neuron/versions.py pins one (2.34.0 came out on
2026-11-30 with the pins at 2.33.0; a worker would then pip the pinned wheels over another release's
venv). :func:`resolve_pinned` therefore checks the image ``latest`` names: each Neuron DLAMI states its
SDK in its description (Neuron DLAMI user guide), and only ``Neuron SDK <pinned>`` is taken. Where
``latest`` has moved on, the newest image of the pinned SDK is looked up the way the guide documents it
(``describe-images`` filtered on name and description); where there is none, one line refuses.
"""

from __future__ import annotations

import re
from typing import Any

from infra.aws import BadInput, InfraError, error_code, translate
from sweep.neuron.environment import COMPETITION_AMI
from sweep.neuron.versions import (
    DLAMI_NAME,
    DLAMI_OS_NAME,
    DLAMI_OWNER,
    DLAMI_SDK_MARK,
    DLAMI_SSM_PARAMETER,
    NEURON_SDK,
)

DEFAULT_SSM_PARAMETER = DLAMI_SSM_PARAMETER
DLAMI_PATH = "/aws/service/neuron/dlami"
# The TorchNeuron 2.14 DLAMI on Ubuntu 24.04, under either name the framework part could take.
TORCHNEURON_PARAMETER = re.compile(
    r"/aws/service/neuron/dlami/(?:torch-neuronx|torchneuron|pytorch)-2\.14(?:\.0)?/ubuntu-24\.04/latest/image_id")
_AMI_ID = re.compile(r"ami-[0-9a-f]{8,17}")
_SDK = re.compile(r"Neuron SDK (\d+(?:\.\d+)+)")


class ParameterMissing(BadInput):
    """The SSM parameter does not exist in the region (its name is a guess): :func:`resolve_pinned` then
    looks the pinned release's image up with describe-images instead."""


def resolve(ssm: Any, parameter: str = DEFAULT_SSM_PARAMETER) -> str:
    """The AMI id the SSM parameter holds in the client's region (the default: the TorchNeuron DLAMI)."""
    if not parameter.startswith("/"):
        raise BadInput(f"SSM parameter {parameter!r}: must be a path starting with '/'")
    from botocore.exceptions import BotoCoreError, ClientError

    what = f"SSM parameter {parameter}"
    try:
        response = ssm.get_parameter(Name=parameter)
    except ClientError as e:
        if error_code(e) != "ParameterNotFound":
            raise translate(e, what) from None
        if parameter == DEFAULT_SSM_PARAMETER:
            found = discover(ssm)
            if found is not None:
                return resolve(ssm, found)
        raise ParameterMissing(f"{what} does not exist in {ssm.meta.region_name} (the {DLAMI_NAME} DLAMI is "
                               "published per region: pick a region with trn2, or pass --ssm-parameter / --ami)"
                               ) from None
    except BotoCoreError as e:
        raise translate(e, what) from None
    value = str(response["Parameter"]["Value"]).strip()
    if not _AMI_ID.fullmatch(value):
        raise InfraError(f"SSM parameter {parameter} holds {value!r}, not an AMI id")
    return value


def discover(ssm: Any) -> str | None:
    """The TorchNeuron DLAMI's parameter among those AWS lists under /aws/service/neuron/dlami, if any."""
    from botocore.exceptions import BotoCoreError, ClientError

    names: list[str] = []
    try:
        for page in ssm.get_paginator("get_parameters_by_path").paginate(Path=DLAMI_PATH, Recursive=True):
            names.extend(p["Name"] for p in page.get("Parameters", []))
    except (BotoCoreError, ClientError) as e:
        raise translate(e, f"listing {DLAMI_PATH}") from None
    matches = sorted(n for n in names if TORCHNEURON_PARAMETER.fullmatch(n))
    return matches[0] if matches else None


def check_ami_id(value: str) -> str:
    """Validate an AMI id given on the command line."""
    if not _AMI_ID.fullmatch(value):
        raise BadInput(f"--ami {value!r}: not an AMI id (ami-0123456789abcdef0)")
    return value


def sdk_of(description: str) -> str | None:
    """The Neuron SDK release an AMI's description names ("... Neuron SDK 2.33.0 ..."), or None."""
    match = _SDK.search(description or "")
    return match.group(1) if match else None


def describe(ec2: Any, image: str) -> dict[str, Any] | None:
    """describe-images of one id; None when the account cannot see it."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        images = ec2.describe_images(ImageIds=[image]).get("Images", [])
    except ClientError as e:
        if error_code(e).startswith("InvalidAMIID"):
            return None
        raise translate(e, f"describe-images {image}") from None
    except BotoCoreError as e:
        raise translate(e, f"describe-images {image}") from None
    return images[0] if images else None


def pinned_release_image(ec2: Any) -> str | None:
    """The newest available TorchNeuron DLAMI (Ubuntu 24.04) whose description names the pinned SDK."""
    from botocore.exceptions import BotoCoreError, ClientError

    filters = [{"Name": "name", "Values": [f"{DLAMI_NAME}*"]},
               {"Name": "description", "Values": [f"*{DLAMI_SDK_MARK}*"]}]
    try:
        images = ec2.describe_images(Owners=[DLAMI_OWNER], Filters=filters).get("Images", [])
    except (BotoCoreError, ClientError) as e:
        raise translate(e, f"describe-images for {DLAMI_NAME}, {DLAMI_SDK_MARK}") from None
    fits = [i for i in images if DLAMI_OS_NAME in i.get("Name", "") and i.get("State", "available") == "available"
            and sdk_of(i.get("Description", "")) == NEURON_SDK]
    return max(fits, key=lambda i: i.get("CreationDate", ""))["ImageId"] if fits else None


def resolve_pinned(ssm: Any, ec2: Any, parameter: str = DEFAULT_SSM_PARAMETER) -> str:
    """The AMI id to boot: the SSM parameter's image if its description names the pinned Neuron SDK, else
    the newest TorchNeuron DLAMI of that SDK; BadInput in one line when neither exists in the region.

    A missing parameter is no reason to stop: the pinned release's image is looked up all the same."""
    try:
        image: str | None = resolve(ssm, parameter)
    except ParameterMissing:
        image = None
    if image is None:
        older = pinned_release_image(ec2)
        if older is not None:
            return older
        raise BadInput(f"SSM parameter {parameter} does not exist in {ec2.meta.region_name}, and it has no "
                       f"{DLAMI_NAME} ({DLAMI_OS_NAME}) image with '{DLAMI_SDK_MARK}' in its description: "
                       "pass --ami, or pick a region with trn2 (docs/neuron.md)")
    info = describe(ec2, image)
    found = sdk_of(info.get("Description", "")) if info else None
    if found == NEURON_SDK:
        return image
    older = pinned_release_image(ec2)
    if older is not None:
        return older
    seen = (f"{info.get('Name') or 'unnamed'}, {f'Neuron SDK {found}' if found else 'no Neuron SDK'} in its description"
            if info else "not visible to describe-images")
    raise BadInput(f"SSM parameter {parameter} resolves to {image} ({seen}), not Neuron {NEURON_SDK} as "
                   f"sweep/neuron/versions.py pins, and {ec2.meta.region_name} has no {DLAMI_NAME} "
                   f"({DLAMI_OS_NAME}) image with '{DLAMI_SDK_MARK}' in its description: pass --ami, or move "
                   "the pins to that release (docs/neuron.md)")


def competition_image(ec2: Any, image: str = COMPETITION_AMI) -> str:
    """The competition profile's image, by id, checked with describe-images in the client's region: the kit
    names the id, not the region, and an AMI id exists in one region only; one line where it is not visible."""
    if describe(ec2, image) is None:
        raise BadInput(f"the competition image {image} is not visible to describe-images in "
                       f"{ec2.meta.region_name} (the kit names no region, and an AMI id belongs to one): pass "
                       "--region where the organisers' image is shared with this account, or --profile latest-sdk")
    return image

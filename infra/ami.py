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
"""

from __future__ import annotations

import re
from typing import Any

from infra.aws import BadInput, InfraError, error_code, translate
from sweep.neuron.versions import DLAMI_NAME, DLAMI_SSM_PARAMETER

DEFAULT_SSM_PARAMETER = DLAMI_SSM_PARAMETER
DLAMI_PATH = "/aws/service/neuron/dlami"
# The TorchNeuron 2.14 DLAMI on Ubuntu 24.04, under either name the framework part could take.
TORCHNEURON_PARAMETER = re.compile(
    r"/aws/service/neuron/dlami/(?:torch-neuronx|torchneuron|pytorch)-2\.14(?:\.0)?/ubuntu-24\.04/latest/image_id")
_AMI_ID = re.compile(r"ami-[0-9a-f]{8,17}")


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
        raise BadInput(f"{what} does not exist in {ssm.meta.region_name} (the {DLAMI_NAME} DLAMI is published "
                       "per region: pick a region with trn2, or pass --ssm-parameter / --ami)") from None
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

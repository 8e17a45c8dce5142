"""The Neuron Deep Learning AMI, looked up through AWS's public SSM parameters.

AWS publishes the latest Neuron DLAMI id per region under ``/aws/service/neuron/dlami/...``
(``aws ssm get-parameters-by-path --path /aws/service/neuron --recursive`` lists them). The Ray
launcher cannot read SSM itself, so ``python -m infra render-cluster`` resolves the id once and
writes it into the cluster config: every node the autoscaler starts later, hours into a sweep, then
boots the same image (and the same Neuron runtime) as the first, even if AWS publishes a new one.
"""

from __future__ import annotations

import re
from typing import Any

from infra.aws import BadInput, InfraError, error_code, translate

# Multi-framework DLAMI on Ubuntu 24.04: Neuron driver, runtime and tools; our own venv on top.
# Older Neuron releases also published .../ubuntu-22.04/...; AWS retires the old OS paths over time.
DEFAULT_SSM_PARAMETER = "/aws/service/neuron/dlami/multi-framework/ubuntu-24.04/latest/image_id"
_AMI_ID = re.compile(r"ami-[0-9a-f]{8,17}")


def resolve(ssm: Any, parameter: str = DEFAULT_SSM_PARAMETER) -> str:
    """The AMI id the SSM parameter holds in the client's region."""
    if not parameter.startswith("/"):
        raise BadInput(f"SSM parameter {parameter!r}: must be a path starting with '/'")
    from botocore.exceptions import BotoCoreError, ClientError

    what = f"SSM parameter {parameter}"
    try:
        response = ssm.get_parameter(Name=parameter)
    except ClientError as e:
        if error_code(e) == "ParameterNotFound":
            raise BadInput(f"{what} does not exist in {ssm.meta.region_name} (Neuron DLAMIs are published "
                           "per region: pick a region with trn2, or pass --ssm-parameter / --ami)") from None
        raise translate(e, what) from None
    except BotoCoreError as e:
        raise translate(e, what) from None
    value = str(response["Parameter"]["Value"]).strip()
    if not _AMI_ID.fullmatch(value):
        raise InfraError(f"SSM parameter {parameter} holds {value!r}, not an AMI id")
    return value


def check_ami_id(value: str) -> str:
    """Validate an AMI id given on the command line."""
    if not _AMI_ID.fullmatch(value):
        raise BadInput(f"--ami {value!r}: not an AMI id (ami-0123456789abcdef0)")
    return value

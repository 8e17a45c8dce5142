"""Ask the Ray autoscaler for trn2 workers ahead of demand, and release them again.

The sweep driver asks the autoscaler for its own trials' resources (``sweep.run.autoscale``) and
withdraws the request when it ends, so a study reaches its concurrency without this. It remains for
capacity wanted before any sweep (warming the compile cache, say) and for withdrawing a request a
driver killed outright left behind. ``request_resources`` keeps capacity for N workers' worth of
``neuron_cores`` whether or not tasks wait for it; the request stays until replaced: ``--workers 0``
withdraws it so idle workers are scaled away (``ray down`` removes them regardless). Run it on the head
(RAY_ADDRESS=auto). A request replaces the one standing, the driver's too, and vice versa.
"""

from __future__ import annotations

import os
from typing import Any

from infra.aws import BadInput, InfraError

CHIPS = {"trn2.3xlarge": 1, "trn2.48xlarge": 16}
PHYSICAL_CORES_PER_CHIP = 8


def cores_per_worker(instance_type: str, lnc: int | None = None) -> int:
    """Logical NeuronCores of one worker: chips x 8 physical cores / LNC (the node's NEURON_LOGICAL_NC_CONFIG)."""
    if instance_type not in CHIPS:
        raise BadInput(f"--type {instance_type!r}: one of {', '.join(CHIPS)}")
    if lnc is None:
        text = os.environ.get("NEURON_LOGICAL_NC_CONFIG", "2")
        if text not in ("1", "2"):
            raise BadInput(f"NEURON_LOGICAL_NC_CONFIG must be 1 or 2, got {text!r}")
        lnc = int(text)
    return CHIPS[instance_type] * PHYSICAL_CORES_PER_CHIP // lnc


def bundles(workers: int, cores: int) -> list[dict[str, float]]:
    """One bundle per worker, so each is placed on its own node (a bundle never spans nodes)."""
    if workers < 0:
        raise BadInput(f"--workers must be >= 0, got {workers}")
    return [{"neuron_cores": float(cores)} for _ in range(workers)]


def request(workers: int, cores: int, sdk: Any = None) -> list[dict[str, float]]:
    """Replace the standing request with ``workers`` x ``cores`` neuron_cores (0 workers: withdraw it)."""
    wanted = bundles(workers, cores)
    if sdk is None:
        import ray
        from ray.autoscaler import sdk as ray_sdk

        sdk = ray_sdk
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            if not address:
                raise BadInput("RAY_ADDRESS is not set: run this on the head node (ray exec CLUSTER.yaml ...)")
            try:
                ray.init(address=address, logging_level="ERROR", log_to_driver=False)
            except Exception as e:  # noqa: BLE001 - a connection failure is one line
                raise InfraError(f"cannot reach the Ray cluster at {address}: {e}") from None
    sdk.request_resources(bundles=wanted)
    return wanted

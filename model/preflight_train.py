"""``model.train`` for the preflight's launch check, each rank also saying which NeuronCore it holds.

    torchrun --nproc_per_node K -m model.preflight_train --config FILE --budget-s N --json

The sweep's preflight launches this instead of ``model.train`` through the trial's own launch plan
(``sweep.neuron.TrialLaunch``, the supervisor's torchrun line). The trainer module is imported first, so
whatever it does before torch loads happens as in a trial; then the Neuron backend is asked whether it is
here (loading torch-neuronx, which checks the process's cores as it does in a trial) and the trainer runs.
When ``TRNSWEEP_PREFLIGHT_RANKS`` names a directory, each rank writes ``rank-RANK.json`` there: its rank,
``NEURON_RT_VISIBLE_CORES`` at start and after training, the backend's current device and the exit code;
on a CUDA node also the GPU the rank trained on (``torch.cuda.current_device()``, which the trainer set to
``cuda:LOCAL_RANK``) and ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from model import train  # first: the trainer's own start-up, as in a trial

RANKS_VAR = "TRNSWEEP_PREFLIGHT_RANKS"
CORES_VAR = "NEURON_RT_VISIBLE_CORES"


def _write(directory: str, report: dict[str, Any]) -> None:
    path = Path(directory) / f"rank-{report['rank']}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report))
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    import torch

    from kernels.neuron import neuron_available

    report: dict[str, Any] = {"rank": int(os.environ.get("RANK", 0)), "pid": os.getpid(),
                              "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
                              "world_size": int(os.environ.get("WORLD_SIZE", 1)),
                              "cores_at_start": os.environ.get(CORES_VAR)}
    directory = os.environ.get(RANKS_VAR)
    try:
        report["neuron"] = neuron_available()
        code = train.main(argv)
    except BaseException as e:
        report.update(exit=1, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
        if directory:
            _write(directory, report)
        raise
    report.update(exit=code, cores=os.environ.get(CORES_VAR))
    neuron = getattr(torch, "neuron", None)
    if report["neuron"] and neuron is not None:
        try:
            report["current_device"] = int(neuron.current_device())
        except Exception as e:  # recorded; the sweep judges the cores it sees
            report["current_device_error"] = f"{type(e).__name__}: {e}"[:300]
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # a CUDA node: which GPU this rank used
        report.update(cuda_device=int(torch.cuda.current_device()),
                      cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))
    if directory:
        _write(directory, report)
    return code


if __name__ == "__main__":
    exit_code = main()
    sys.stdout.flush()
    sys.exit(exit_code)

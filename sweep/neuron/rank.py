"""Start one torchrun rank on its own NeuronCore, then run the trainer in the same process.

torchrun gives every rank the same environment, but TorchNeuron wants exactly one NeuronCore visible to
each process of a distributed run. The supervisor therefore runs ``torchrun ... -m sweep.neuron.rank
model.train ARGS``: this module sets ``NEURON_RT_VISIBLE_CORES`` to the rank's entry of
``TRNSWEEP_RANK_CORES`` (:func:`sweep.neuron.launch.rank_env`) before torch or torch-neuronx is imported,
then runs the trainer module as ``__main__`` (or, for a path ending in ``.py``, a team's script:
``model.script.run``'s torchrun). Importing it pulls in no torch.
"""

from __future__ import annotations

import os
import runpy
import sys

from sweep.neuron.launch import LaunchError, rank_env


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m sweep.neuron.rank MODULE [ARGS...]", file=sys.stderr)
        return 2
    try:
        os.environ.update(rank_env(os.environ))
    except LaunchError as e:
        print(f"sweep.neuron.rank: {e}", file=sys.stderr)
        return 2
    module, *rest = args
    sys.argv = [module, *rest]
    if module.endswith(".py"):
        sys.path.insert(0, os.path.dirname(os.path.abspath(module)))
        runpy.run_path(module, run_name="__main__")
    else:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

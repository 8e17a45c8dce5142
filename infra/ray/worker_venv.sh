#!/usr/bin/env bash
# Runs once on every trn2 worker (worker_setup_commands in trn2.yaml), before the project is installed:
#     bash worker_venv.sh DLAMI_VENV [VENV]
# makes VENV (default ~/trnsweep/.venv) a venv built from the TorchNeuron DLAMI's venv whose packages
# (torch, torch-neuronx, neuronx-cc, nki as AWS built and tested them) it also sees, through a .pth
# file: nothing is written under /opt, and pip then installs only what the DLAMI lacks.
set -euo pipefail
dlami=${1:?usage: worker_venv.sh DLAMI_VENV [VENV]}
venv=${2:-$HOME/trnsweep/.venv}
if [ ! -x "$dlami/bin/python" ]; then
    echo "worker_venv.sh: $dlami is missing: boot the TorchNeuron DLAMI (python -m infra ami prints its id)" >&2
    exit 1
fi
[ -x "$venv/bin/python" ] || "$dlami/bin/python" -m venv "$venv"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$dlami/bin/python" -c 'import sysconfig; p = sysconfig.get_paths(); print(p["purelib"]); print(p["platlib"])' \
    > "$site/torchneuron-dlami.pth"

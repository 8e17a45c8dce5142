#!/usr/bin/env bash
# Runs once on every trn2 worker of a `competition` cluster (worker_setup_commands in trn2.yaml):
#     bash image_venv.sh VENV_NAME_OR_PATH
# finds the competition image's own venv by name (/opt, then $HOME, /home/ubuntu, /opt/conda/envs: the
# kit names the venv, not its directory, so these places are guesses, sweep/neuron/environment.py) and
# prints its python. It only reads: nothing is installed into that venv, ever (the kit forbids it). The
# service runs from a venv of its own (~/trnsweep/.venv); only trials' trainers use this python.
set -euo pipefail
name=${1:?usage: image_venv.sh VENV_NAME_OR_PATH}
if [ "${name#/}" != "$name" ]; then
    candidates=("$name")
else
    candidates=("/opt/$name" "$HOME/$name" "/home/ubuntu/$name" "/opt/conda/envs/$name")
fi
for dir in "${candidates[@]}"; do
    if [ -x "$dir/bin/python" ]; then
        echo "$dir/bin/python"
        exit 0
    fi
done
echo "image_venv.sh: no venv $name on this node (looked in ${candidates[*]}): boot the competition image" >&2
exit 1

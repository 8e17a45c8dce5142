#!/usr/bin/env bash
# The CUDA preflight in one go on a fresh GPU machine (docs/neuron.md, "Preflight on a CUDA node"):
#   bench/cuda_preflight.sh            # from the repository root or anywhere; needs python3, make, nvidia-smi
# 1. `make install`, then makes sure the venv's torch is a CUDA build (PyPI's torch for Linux x86_64 is; a
#    local CPU wheel on pip's find-links would shadow it, so then torch is installed again from PyPI alone);
# 2. `python -m sweep preflight` on sweep/studies/cuda-probe.toml with one rank per GPU (at most 8): versions,
#    device, a launch at those ranks, compile, nvidia-smi, artifacts, and the 60 s throughput check;
# 3. the throughput probe alone, `python -m model.preflight throughput --device cuda --seconds 60 --json`
#    (inductor's cache is warm by now), unless steps 1-2 left under 90 s of the 8-minute target.
# Prints the preflight's table and JSON report, then the probe's JSON line; everything also lands in $OUT.
# Exit: the preflight's (0 all passed, 1 a check failed), 2 when this is not a GPU node or torch has no CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/cuda-preflight}
PROBE_SECONDS=${PROBE_SECONDS:-60}
TARGET_S=${TARGET_S:-480}
PY=.venv/bin/python
mkdir -p "$OUT"
log() { echo "cuda_preflight: $* (${SECONDS} s)" >&2; }

if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "cuda_preflight: nvidia-smi is not on PATH: not a GPU node, or the NVIDIA driver is not installed" >&2
    exit 2
fi
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader | tee "$OUT/nvidia-smi.csv" >&2

log "make install"
make install >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log" >&2; exit 2; }
cuda_build() { "$PY" -c 'import torch; print(torch.version.cuda or "")'; }
if [ -z "$(cuda_build)" ]; then
    pin=$(sed -n 's/^TORCH_PIN ?= *//p' Makefile)
    log "the venv's torch is a CPU build; installing $pin from PyPI alone (pip's config files and index variables ignored)"
    env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u PIP_INDEX_URL -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null \
        "$PY" -m pip install -q --force-reinstall --index-url https://pypi.org/simple "$pin" \
        >>"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log" >&2; exit 2; }
fi
build=$(cuda_build)
if [ -z "$build" ]; then
    echo "cuda_preflight: torch in .venv is still a CPU-only build (torch.version.cuda is None); see $OUT/install.log" >&2
    exit 2
fi
log "torch $("$PY" -c 'import torch; print(torch.__version__)') with CUDA $build"

gpus=$(nvidia-smi -L | grep -c '^GPU ' || true)
ranks=$(( gpus < 1 ? 1 : (gpus > 8 ? 8 : gpus) ))
sed "s/^ranks = .*/ranks = $ranks/" sweep/studies/cuda-probe.toml >"$OUT/cuda-probe.toml"
log "python -m sweep preflight at $ranks rank(s)"
set +e
TRNSWEEP_PREFLIGHT_REPORT="$OUT/preflight.json" timeout 420 "$PY" -m sweep preflight "$OUT/cuda-probe.toml" \
    | tee "$OUT/preflight.out"
code=${PIPESTATUS[0]}
set -e
log "preflight exited $code"

if [ $(( TARGET_S - SECONDS )) -gt $(( PROBE_SECONDS + 90 )) ]; then
    log "the throughput probe alone, $PROBE_SECONDS s"
    timeout $(( PROBE_SECONDS + 240 )) "$PY" -m model.preflight throughput --device cuda --seconds "$PROBE_SECONDS" \
        --json | tee "$OUT/throughput.json" || log "the throughput probe failed or timed out"
else
    log "skipped the throughput probe alone: the preflight's throughput check has the figures (its data)"
fi
log "done; files in $OUT"
exit "$code"

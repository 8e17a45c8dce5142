#!/usr/bin/env bash
# Runs from cron on every trn2 worker (every 5 minutes; see worker_setup_commands in trn2.yaml):
# push this node's new compile-cache entries and trial working files to S3, then pull what other nodes
# compiled. One run at a time; a failed step does not stop the others.
set -u
# shellcheck source=/dev/null
. "$HOME/trnsweep/cluster.env"
cd "$HOME/trnsweep" || exit 1
exec 9>"$HOME/.trnsweep-sync.lock"
flock -n 9 || exit 0
py=.venv/bin/python
# Compile-cache entries only once unchanged for 5 minutes: a half-written NEFF must never be shared.
$py -m infra sync --quiet --min-age-s 300 "$NEURON_CACHE_DIR" "$TRNSWEEP_S3/neuron-cache"
# Trials' working files after a minute: the autoscaler removes an idle node after 10.
$py -m infra sync --quiet --min-age-s 60 "$TRNSWEEP_TRIAL_FILES" "$TRNSWEEP_S3/trial-files"
$py -m infra sync --quiet --min-age-s 0 "$TRNSWEEP_S3/neuron-cache" "$NEURON_CACHE_DIR"

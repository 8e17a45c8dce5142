#!/usr/bin/env bash
# Runs as root on every trn2 worker (worker_setup_commands in trn2.yaml): the user that a team's script trials
# run as (SWEEP_TRIAL_USER in cluster.env; sweep/run/trialuser.py), and the service's files shut to it.
#   sudo bash trial_user.sh USER SERVICE_HOME
# Idempotent: a node set up again gets the same user and modes.
set -euo pipefail
user="$1"
home="$2"
# A system user with its own group and no other: no login shell, no home directory, no password.
id -u "$user" >/dev/null 2>&1 ||
    useradd --system --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin "$user"
# The service's home: searchable, so a trial can read and run the checkout and its venv (~/trnsweep), but not
# listable; the Ray token (~/.ray/auth_token) and the other dot folders are the service's alone.
chmod 711 "$home"
mkdir -p "$home/.ray"
chown "$(stat -c %u:%g "$home")" "$home/.ray"
chmod 700 "$home/.ray"
for d in "$home"/.[!.]*; do
    if [ -d "$d" ] && [ ! -L "$d" ]; then chmod go-rwx "$d"; fi
done
# Ray's session files (the raylet's sockets, every worker's logs): root's alone (Ray runs as root here), so a
# trial can neither talk to the local raylet nor read another trial's log.
mkdir -p /tmp/ray
chmod 700 /tmp/ray
# The instance metadata service hands out the worker role's credentials (S3: the shared compile cache, the
# trial files): never to a trial.
rule=(OUTPUT -m owner --uid-owner "$user" -d 169.254.169.254 -j REJECT)
iptables -w -C "${rule[@]}" 2>/dev/null || iptables -w -A "${rule[@]}"

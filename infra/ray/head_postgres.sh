#!/usr/bin/env bash
# PostgreSQL for the study, on the Ray head (render-cluster --db head). Idempotent: `ray up` reruns it.
#
# - listens on the head's private address; pg_hba admits the study role from the VPC only, with a
#   password (scram-sha-256); the security group already limits the port to cluster members;
# - max_connections 400: every worker holds up to 3 connections (sweep/store/opening.py), 64 workers ~ 200;
# - the generated password goes to ~/.trnsweep/db.json (mode 600, RDS-style JSON), never to argv,
#   the cluster config or a log. The driver reads it with SWEEP_DB_SECRET=file:~/.trnsweep/db.json.
# The data lives on the head's disk and dies with `ray down`: dump it first (docs/aws.md).
set -euo pipefail

DB_NAME=${TRNSWEEP_DB_NAME:-optuna}
DB_USER=${TRNSWEEP_DB_USER:-optuna}
CONF_DIR=$HOME/.trnsweep
CONF=$CONF_DIR/db.json

if ! command -v pg_lsclusters >/dev/null 2>&1; then
    sudo apt-get -qq update
    sudo DEBIAN_FRONTEND=noninteractive apt-get -qq install -y postgresql >/dev/null
fi

imds() {  # IMDSv2: a session token first, then the metadata path
    local token
    token=$(curl -sf -X PUT http://169.254.169.254/latest/api/token -H 'X-aws-ec2-metadata-token-ttl-seconds: 60')
    curl -sf -H "X-aws-ec2-metadata-token: $token" "http://169.254.169.254/latest/meta-data/$1"
}
HOST_IP=$(imds local-ipv4)
MAC=$(imds mac)
VPC_CIDR=$(imds "network/interfaces/macs/$MAC/vpc-ipv4-cidr-block")

VERSION=$(pg_lsclusters --no-header | awk 'NR == 1 { print $1 }')
PGCONF=/etc/postgresql/$VERSION/main
sudo tee "$PGCONF/conf.d/trnsweep.conf" >/dev/null <<EOF
listen_addresses = 'localhost,$HOST_IP'
max_connections = 400
shared_buffers = 1GB
password_encryption = 'scram-sha-256'
EOF
HBA_LINE="host $DB_NAME $DB_USER $VPC_CIDR scram-sha-256"
sudo grep -qxF "$HBA_LINE" "$PGCONF/pg_hba.conf" || echo "$HBA_LINE" | sudo tee -a "$PGCONF/pg_hba.conf" >/dev/null
sudo systemctl restart "postgresql@$VERSION-main"

mkdir -p "$CONF_DIR"
chmod 700 "$CONF_DIR"
if [ ! -s "$CONF" ]; then
    (umask 077 && python3 - "$CONF" "$DB_USER" "$DB_NAME" "$HOST_IP" <<'PY'
import json, secrets, sys
path, user, db, host = sys.argv[1:]
with open(path, "w") as f:
    json.dump({"engine": "postgres", "username": user, "password": secrets.token_urlsafe(24),
               "host": host, "port": 5432, "dbname": db}, f)
PY
    )
fi
# Keep the host current (a replaced head gets a new address) without touching the password.
python3 - "$CONF" "$HOST_IP" <<'PY'
import json, sys
path, host = sys.argv[1:]
data = json.load(open(path))
data["host"] = host
with open(path, "w") as f:
    json.dump(data, f)
PY
PASSWORD=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["password"])' "$CONF")

# Role and database. The password reaches psql through this here-document (stdin), never argv;
# token_urlsafe() yields only [A-Za-z0-9_-], so it needs no quoting inside the literal.
sudo -u postgres psql -q -v ON_ERROR_STOP=1 <<SQL
\\set user '$DB_USER'
\\set db '$DB_NAME'
\\set pw '$PASSWORD'
SELECT format('CREATE ROLE %I LOGIN', :'user') WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = :'user')
\\gexec
SELECT format('ALTER ROLE %I PASSWORD %L', :'user', :'pw')
\\gexec
SELECT format('CREATE DATABASE %I OWNER %I', :'db', :'user') WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = :'db')
\\gexec
SQL
unset PASSWORD
echo "trnsweep: PostgreSQL $VERSION on $HOST_IP:5432, database $DB_NAME; credentials in $CONF"

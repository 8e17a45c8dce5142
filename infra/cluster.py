"""Render ``infra/ray/trn2.yaml`` into a cluster config that ``ray up`` can use as is.

The template holds ``@NAME@`` placeholders and the structure; rendering fills them, sets the numbers
(``neuron_cores`` from the logical-core config, worker maxima, spot), writes ``cluster.env`` (the
environment every node sources; names and paths, never a password) and snapshots the checkout, all
under ``runs/aws/<cluster>/``. The rendered file is checked against Ray's own schema before it is
written, so a config that Ray would refuse never leaves this function.
"""

from __future__ import annotations

import copy
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infra.aws import BadInput, InfraError
from infra.network import group_name
from sweep.neuron import environment
from sweep.neuron.versions import DLAMI_VENV, NEURON_TOOLS_BIN

TEMPLATE = Path(__file__).resolve().parent / "ray" / "trn2.yaml"
REPO_ROOT = Path(__file__).resolve().parent.parent
SMALL, LARGE, HEAD = "trn2-3xlarge", "trn2-48xlarge", "head"
CHIPS = {SMALL: 1, LARGE: 16}
PHYSICAL_CORES_PER_CHIP = 8
DEFAULT_TORCH_PIN = "torch==2.13.0"
NEURON_INDEX = "https://pip.repos.neuron.amazonaws.com"
TRIAL_USER = "trnsweep-trial"  # the system user script trials run as on a worker (infra/ray/trial_user.sh)
_PLACEHOLDER = re.compile(r"@([A-Z_]+)@")


@dataclass
class Options:
    """Everything that varies between clusters; defaults give a phase-1 cluster of up to 8 trn2.3xlarge."""

    region: str
    ami: str
    bucket: str
    zones: list[str] = field(default_factory=list)
    cluster_name: str = "trnsweep"
    head_type: str = "m7i.2xlarge"
    lnc: int = 2
    spot: bool = False
    max_small: int = 8
    max_large: int = 0
    db: str = "head"  # "head": PostgreSQL on the head node; "secret": SWEEP_DB_SECRET names an external one
    db_secret: str | None = None
    db_host: str | None = None  # for RDS-managed secrets, which hold only username and password
    db_name: str | None = None
    torch_pin: str = DEFAULT_TORCH_PIN
    auth_token: Path = field(default_factory=lambda: Path("~/.ray/auth_token"))
    source: Path = REPO_ROOT
    out_dir: Path | None = None
    # Where trials run (sweep/neuron/environment.py): "latest-sdk", the pinned TorchNeuron DLAMI with our pins in a
    # worker venv layered on its own; "competition", the kit's image with its venv untouched beside the service's.
    profile: str = environment.LATEST_SDK
    image_venv: str = environment.COMPETITION_VENV

    def check(self) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9-]{0,30}", self.cluster_name):
            raise BadInput(f"--cluster-name {self.cluster_name!r}: lower-case letters, digits and '-', at most 31")
        if self.lnc not in (1, 2):
            raise BadInput(f"--lnc must be 1 or 2, got {self.lnc}")
        if self.max_small < 0 or self.max_large < 0 or self.max_small + self.max_large < 1:
            raise BadInput("--max-3xl and --max-48xl must be >= 0 and allow at least one worker")
        if self.db not in ("head", "secret"):
            raise BadInput(f"--db must be 'head' or 'secret', got {self.db!r}")
        if self.db == "secret" and not self.db_secret:
            raise BadInput("--db secret needs --db-secret (a Secrets Manager id or ARN)")
        for flag, value in (("--db-host", self.db_host), ("--db-name", self.db_name)):
            if value is not None and not re.fullmatch(r"[A-Za-z0-9._-]+", value):
                raise BadInput(f"{flag} {value!r}: a host name or database name")
        if not re.fullmatch(r"torch==[0-9][0-9A-Za-z.+]*", self.torch_pin):
            raise BadInput(f"--torch-pin {self.torch_pin!r}: expected torch==VERSION")
        if not self.zones:
            raise BadInput("no availability zones: pass --zones a,b or --zones auto")
        if self.profile not in environment.PROFILES:
            raise BadInput(f"--profile must be one of {', '.join(environment.PROFILES)}, got {self.profile!r}")
        if not re.fullmatch(r"/?[A-Za-z0-9._/-]+", self.image_venv) or ".." in self.image_venv:
            raise BadInput(f"--image-venv {self.image_venv!r}: a venv name or absolute path")


def cores_per_chip(lnc: int) -> int:
    """Logical NeuronCores per Trainium2 chip: 8 physical cores grouped by the logical-core config."""
    return PHYSICAL_CORES_PER_CHIP // lnc


def makefile_torch_pin(makefile: Path = REPO_ROOT / "Makefile") -> str:
    """The Makefile's TORCH_PIN, so the head (CPU only) installs the torch the Makefile does; trn2 workers
    take the TorchNeuron DLAMI's torch (sweep/neuron/versions.py)."""
    try:
        match = re.search(r"^TORCH_PIN\s*\?=\s*(\S+)\s*$", makefile.read_text(), re.M)
    except OSError:
        return DEFAULT_TORCH_PIN
    return match.group(1) if match else DEFAULT_TORCH_PIN


def load_template(path: Path = TEMPLATE) -> dict[str, Any]:
    import yaml

    return yaml.safe_load(path.read_text())


def env_file(opts: Options) -> str:
    """``cluster.env``: sourced by every node's login shell and the Ray start commands.

    Every value from the options is shell-quoted (:func:`shlex.quote`): a secret id with a space, a quote,
    ``$(...)`` or a backtick stays one literal value when ``sh`` sources the file. Only our own constants
    that name ``$HOME`` are left for the shell to expand.
    """
    q = shlex.quote
    secret = q(opts.db_secret or "") if opts.db == "secret" else '"file:$HOME/.trnsweep/db.json"'
    lines = [
        "# Generated by `python -m infra render-cluster`; sourced on every node. No secrets here:",
        "# SWEEP_DB_SECRET names where the database credentials live (python -m infra with-db reads them).",
        f"export TRNSWEEP_CLUSTER={q(opts.cluster_name)}",
        f"export AWS_REGION={q(opts.region)}",
        f"export AWS_DEFAULT_REGION={q(opts.region)}",
        "export RAY_AUTH_MODE=token",
        "export RAY_ADDRESS=auto  # drivers started on a node (make sweep) join this cluster",
        f"export TRNSWEEP_S3={q(f's3://{opts.bucket}')}",
        f"export SWEEP_DB_SECRET={secret}",
        *([f"export SWEEP_DB_HOST={q(opts.db_host)}"] if opts.db_host else []),
        *([f"export SWEEP_DB_NAME={q(opts.db_name)}"] if opts.db_name else []),
        "# The sweep's artifact store: each finished trial's files (sweep/store/artifacts.py uploads them).",
        f"export SWEEP_ARTIFACTS={q(f's3://{opts.bucket}/artifacts')}",
        "# Trials' working files, on the worker that ran them (also those of trials killed mid-run);",
        "# infra/ray/node_sync.sh copies them to $TRNSWEEP_S3/trial-files before the node is scaled away.",
        'export TRNSWEEP_TRIAL_FILES="$HOME/trnsweep/runs/artifacts"',
        '# Neuron compile caches (TorchNeuron NEFFs; the XLA path\'s cache), synced with $TRNSWEEP_S3/neuron-cache.',
        'export NEURON_CACHE_DIR="$HOME/neuron-cache"',
        'export TORCH_NEURONX_NEFF_CACHE_DIR="$NEURON_CACHE_DIR/neff"',
        'export NEURON_COMPILE_CACHE_URL="$NEURON_CACHE_DIR/xla"',
        f"export NEURON_LOGICAL_NC_CONFIG={q(str(opts.lnc))}",
        "# The user a team's script trials run as (sweep/run/trialuser.py), made by infra/ray/trial_user.sh.",
        f"export SWEEP_TRIAL_USER={q(TRIAL_USER)}",
        "# Where trials run (sweep/neuron/environment.py); under competition the image venv's name as well.",
        f"export {environment.PROFILE_VAR}={q(opts.profile)}",
        *([f"export {environment.VENV_VAR}={q(opts.image_venv)}"] if opts.profile == environment.COMPETITION else []),
        'case ":$PATH:" in *":$HOME/trnsweep/.venv/bin:"*) ;; *) export PATH="$HOME/trnsweep/.venv/bin:$PATH" ;; esac',
        "# The Neuron tools (neuron-ls, neuron-monitor; package aws-neuronx-tools), which sweep/neuron/ runs.",
        f'case ":$PATH:" in *":{NEURON_TOOLS_BIN}:"*) ;; *) export PATH="$PATH:{NEURON_TOOLS_BIN}" ;; esac',
        "",
    ]
    return "\n".join(lines)


def render(opts: Options, template: dict[str, Any] | None = None, source_dir: Path | None = None) -> dict[str, Any]:
    """The cluster config for ``opts`` (a new dict; the template is not modified)."""
    opts.check()
    config = copy.deepcopy(template if template is not None else load_template())
    values = {
        "CLUSTER": opts.cluster_name,
        "GROUP": group_name(opts.cluster_name),
        "REGION": opts.region,
        "ZONES": ",".join(opts.zones),
        "AMI": opts.ami,
        "HEAD_TYPE": opts.head_type,
        "SOURCE": str(source_dir if source_dir is not None else opts.source),
        "AUTH_TOKEN": str(opts.auth_token),
        "TORCH_PIN": opts.torch_pin,
        "TRIAL_USER": TRIAL_USER,
        **worker_setup(opts),
        "HEAD_DB_SETUP": "bash ~/trnsweep/infra/ray/head_postgres.sh" if opts.db == "head" else "",
    }
    config = _substitute(config, values)
    types = config["available_node_types"]
    per_chip = cores_per_chip(opts.lnc)
    for name, maximum in ((SMALL, opts.max_small), (LARGE, opts.max_large)):
        node = types[name]
        node["max_workers"] = maximum
        node["min_workers"] = 0
        node["resources"]["neuron_cores"] = CHIPS[name] * per_chip
        if opts.spot:
            node["node_config"]["InstanceMarketOptions"] = {"MarketType": "spot"}
        else:
            node["node_config"].pop("InstanceMarketOptions", None)
    config["max_workers"] = opts.max_small + opts.max_large
    left = _placeholders(config)
    if left:
        raise InfraError(f"template {TEMPLATE}: unfilled placeholders {', '.join(sorted(left))}")
    validate(config)
    return config


def worker_setup(opts: Options) -> dict[str, str]:
    """The two worker set-up commands of the profile: the venv, then the project.

    latest-sdk: a worker venv layered on the DLAMI's (worker_venv.sh), then the pinned `neuron` extra into it.
    competition: the image venv found and only read (image_venv.sh), then the service's own venv as
    `make install` builds it (the CPU torch, as on the head): nothing goes into the image's venv."""
    if opts.profile == environment.COMPETITION:
        return {"WORKER_VENV": f"bash ~/trnsweep/infra/ray/image_venv.sh '{opts.image_venv}'",
                "WORKER_INSTALL": "cd ~/trnsweep && PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu "
                                  f"make install TORCH_PIN='{opts.torch_pin}'"}
    return {"WORKER_VENV": f"bash ~/trnsweep/infra/ray/worker_venv.sh '{DLAMI_VENV}'",
            "WORKER_INSTALL": "cd ~/trnsweep && .venv/bin/pip install -q -e '.[neuron]' --extra-index-url "
                              f"{NEURON_INDEX} --extra-index-url https://download.pytorch.org/whl/cpu"}


def _substitute(node: Any, values: dict[str, str]) -> Any:
    """Replace @NAME@ in every string; list items that become empty are dropped (optional commands)."""
    if isinstance(node, dict):
        return {k: _substitute(v, values) for k, v in node.items()}
    if isinstance(node, list):
        items = [_substitute(v, values) for v in node]
        return [v for v in items if v != ""]
    if isinstance(node, str):
        return _PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), node)
    return node


def _placeholders(node: Any) -> set[str]:
    if isinstance(node, dict):
        return set().union(*(_placeholders(v) for v in node.values())) if node else set()
    if isinstance(node, list):
        return set().union(*(_placeholders(v) for v in node)) if node else set()
    if isinstance(node, str):
        return set(_PLACEHOLDER.findall(node))
    return set()


def validate(config: dict[str, Any]) -> None:
    """Ray's own checks: the JSON schema shipped in the ray package, plus its cross-field rules."""
    import jsonschema
    from ray.autoscaler._private.util import validate_config

    try:
        validate_config(config)
    except jsonschema.ValidationError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(top level)"
        raise InfraError(f"cluster config fails Ray's schema at {where}: {e.message}") from None
    except (ValueError, RuntimeError) as e:
        raise InfraError(f"cluster config rejected by Ray: {e}") from None


def snapshot(source: Path, dest: Path) -> int:
    """Copy the checkout's tracked and untracked-but-not-ignored files to ``dest``; returns the count.

    What ``git`` would commit is what the nodes get: no ``.venv``, ``runs/``, caches or ignored secrets.
    """
    try:
        out = subprocess.run(["git", "-C", str(source), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        raise BadInput(f"{source}: not a git checkout (the snapshot copies what git tracks)") from None
    if dest.exists():
        shutil.rmtree(dest)
    count = 0
    for rel in sorted({p for p in out.decode().split("\0") if p}):
        src = source / rel
        if not src.is_file():  # deleted but still in the index
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)
        count += 1
    return count


def write(opts: Options) -> dict[str, Path]:
    """Snapshot, env file and rendered config under ``runs/aws/<cluster>/``; returns their paths."""
    import yaml

    out_dir = opts.out_dir or (REPO_ROOT / "runs" / "aws" / opts.cluster_name)
    token = opts.auth_token.expanduser()
    if not token.is_file():
        raise BadInput(f"no Ray auth token at {token}: run `ray get-auth-token --generate` first (docs/aws.md)")
    out_dir.mkdir(parents=True, exist_ok=True)
    src = out_dir / "src"
    snapshot(opts.source, src)
    (src / "cluster.env").write_text(env_file(opts))
    config = render(opts, source_dir=src.resolve())
    path = out_dir / "cluster.yaml"
    header = (f"# Generated by `python -m infra render-cluster` from {TEMPLATE.relative_to(REPO_ROOT)}; "
              "edit the template or the flags, not this file.\n")
    path.write_text(header + yaml.safe_dump(config, sort_keys=False, width=120))
    return {"config": path, "source": src, "env": src / "cluster.env"}

"""An ``s3://`` compile cache works for the cache TorchNeuron reads (TORCH_NEURONX_NEFF_CACHE_DIR, a path).

The trial pulls the prefix's NEFFs into a node mirror before the trainer starts and pushes what it
compiled afterwards. The copying is infra's sync (``python -m infra sync`` on a node); here the same
functions run in-process against moto's S3.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import boto3
import moto
import pytest

from infra import sync as infra_sync  # noqa: E402  (tests may use infra; sweep runs it as a CLI)
from sweep import neuron

BUCKET = "trnsweep-cache-test"
REGION = "us-east-2"


@pytest.fixture
def s3(monkeypatch):
    for var, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                       ("AWS_SESSION_TOKEN", "testing"), ("AWS_DEFAULT_REGION", REGION),
                       ("AWS_CONFIG_FILE", os.devnull), ("AWS_SHARED_CREDENTIALS_FILE", os.devnull)):
        monkeypatch.setenv(var, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    with moto.mock_aws():
        client = boto3.client("s3", region_name=REGION)
        client.create_bucket(Bucket=BUCKET, CreateBucketConfiguration={"LocationConstraint": REGION})
        yield client


def test_an_s3_cache_is_pulled_into_the_neff_mirror_and_the_new_graphs_pushed(s3, tmp_path):
    s3.put_object(Bucket=BUCKET, Key="cache/neff/ab/graph1/model.neff", Body=b"compiled elsewhere")
    calls = []

    def sync(src: str, dst: str, min_age_s: float) -> str | None:
        calls.append((src, dst, min_age_s))
        infra_sync.sync(s3, src, dst, min_age_s=min_age_s)
        return None

    node_env = {"PATH": "", neuron.NODE_CACHE_VAR: str(tmp_path / "nc")}
    plan = neuron.TrialLaunch.prepare({"device": "neuron"}, 1, {}, f"s3://{BUCKET}/cache", node_env=node_env,
                                      sync=sync)
    mirror = tmp_path / "nc-s3" / BUCKET / "cache" / "neff"
    assert plan.env[neuron.NEFF_CACHE_VAR] == str(mirror)  # what TorchNeuron reads
    assert (mirror / "ab" / "graph1" / "model.neff").read_bytes() == b"compiled elsewhere"  # before the trainer
    assert calls == [(f"s3://{BUCKET}/cache/neff", str(mirror), 0.0)]
    new = mirror / "cd" / "graph2" / "model.neff"  # the trainer compiles a graph the bucket lacks
    new.parent.mkdir(parents=True)
    new.write_bytes(b"compiled here")
    os.utime(new, (0, 0))  # older than the push's minimum age: complete
    attrs = plan.finished({"device": "neuron", "steps": 3}, 1.0, 2.0)
    assert attrs["graph_cache"] == "miss" and attrs["graph_cache_new_entries"] == 1
    assert calls[1] == (str(mirror), f"s3://{BUCKET}/cache/neff", neuron.PUSH_MIN_AGE_S)
    body = s3.get_object(Bucket=BUCKET, Key="cache/neff/cd/graph2/model.neff")["Body"].read()
    assert body == b"compiled here" and "compile_cache_error" not in attrs


def test_a_failed_pull_is_recorded_in_one_line_and_the_trial_still_runs(tmp_path):
    node_env = {"PATH": "", neuron.NODE_CACHE_VAR: str(tmp_path / "nc")}
    plan = neuron.TrialLaunch.prepare({"device": "neuron"}, 1, {}, "s3://nobucket/p", node_env=node_env,
                                      sync=lambda src, dst, age: "AccessDenied: s3://nobucket/p/neff")
    assert plan.attrs["compile_cache_error"] == "pull: AccessDenied: s3://nobucket/p/neff"
    assert plan.finished({}, 1.0, None)["graph_cache"] == "none"  # nothing compiled: nothing pushed


def test_node_and_shared_caches_need_no_copy(tmp_path):
    def refuse(*_):
        raise AssertionError("no sync for a node or shared cache")

    for cache in ("", str(tmp_path / "fsx")):
        plan = neuron.TrialLaunch.prepare({"device": "neuron"}, 1, {}, cache, sync=refuse,
                                          node_env={"PATH": "", neuron.NODE_CACHE_VAR: str(tmp_path / "nc")})
        plan.finished({"steps": 2}, 1.0, 2.0)


def test_the_sync_command_is_infras_cli_and_its_failure_is_one_line(tmp_path):
    cmd = neuron.sync_command("s3://b/p/neff", "/x/neff", 0.0)
    assert cmd == [sys.executable, "-m", "infra", "sync", "--quiet", "--min-age-s", "0", "s3://b/p/neff", "/x/neff"]
    help_text = subprocess.run([*cmd[:4], "--help"], capture_output=True, text=True, cwd=neuron.cache.REPO_ROOT)
    assert "--min-age-s" in help_text.stdout and "--quiet" in help_text.stdout  # infra's CLI takes these flags
    error = neuron.run_sync(str(tmp_path), str(tmp_path / "other"))  # neither side is s3://
    assert error is not None and "\n" not in error and error.endswith("not an s3:// URL")


# -- TorchNeuron's two names for the cache switch -------------------------------------------------------

@pytest.mark.parametrize("var", neuron.NEFF_DISABLE_VARS)
@pytest.mark.parametrize("value, off", [("1", True), ("TRUE", True), ("yes", True), ("0", False), ("", False)])
def test_a_trial_that_finds_either_disable_variable_set_says_so_in_one_line(tmp_path, var, value, off):
    node_env = {"PATH": "", neuron.NODE_CACHE_VAR: str(tmp_path / "nc"), var: value}
    plan = neuron.TrialLaunch.prepare({"device": "neuron"}, 1, {}, "", node_env=node_env)
    said = plan.attrs.get("compile_cache_disabled", "")
    assert bool(said) == off and "\n" not in said
    assert not off or said.startswith(f"{var}={value} ")
    assert not set(neuron.NEFF_DISABLE_VARS) & set(plan.env)  # the sweep never sets either


def test_both_names_are_read_and_trial_env_counts_too(tmp_path):
    node_env = {"PATH": "", neuron.NODE_CACHE_VAR: str(tmp_path / "nc"), neuron.NEFF_DISABLE_VAR: "1"}
    plan = neuron.TrialLaunch.prepare({"device": "neuron"}, 1, {neuron.NEFF_DISABLE_VAR_DOCS: "true"}, "",
                                      node_env=node_env)
    assert plan.attrs["compile_cache_disabled"].startswith(
        "TORCH_NEURONX_NEFF_DISABLE_CACHE=1, TORCH_NEURONX_DISABLE_NEFF_CACHE=true ")


def test_a_nearly_full_cache_disk_turns_the_persistent_cache_off(tmp_path, monkeypatch):
    monkeypatch.setattr(neuron.trial, "MIN_CACHE_FREE_BYTES", 1 << 62)  # more than any disk here has free
    plan = neuron.TrialLaunch.prepare({"device": "neuron"}, 1, {}, "",
                                      node_env={"PATH": "", neuron.NODE_CACHE_VAR: str(tmp_path / "nc")})
    said = plan.attrs["compile_cache_error"]
    assert "GiB free under" in said and "may fill the disk" in said
    assert plan.env[neuron.NEFF_DISABLE_VAR] == "1" and neuron.NEFF_DISABLE_VAR_DOCS not in plan.env
    assert plan.attrs["compile_cache_disabled"].startswith("TORCH_NEURONX_NEFF_DISABLE_CACHE=1 ")


# -- a script trial's private cache over the shared one (sweep/neuron/overlay.py) -------------------------------

def shared_cache(tmp_path):
    """A shared cache directory holding one compiled graph (TorchNeuron's ``ab/cd/<key>.neff`` layout)."""
    neff = tmp_path / "fsx" / "neff"
    old = neff / "ab" / "cd" / ("ab" + "cd" + "0" * 28 + ".neff")
    old.parent.mkdir(parents=True)
    old.write_bytes(b"graph compiled by an earlier trial")
    return neff, old


def rename_into(path, data: bytes) -> None:
    """How TorchNeuron writes an entry: a temporary file beside it, renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / ".tmp.x"
    tmp.write_bytes(data)
    os.replace(tmp, path)


@pytest.mark.parametrize("seed", neuron.overlay.SEEDS)
def test_a_private_cache_publishes_new_entries_and_never_replaces_a_shared_one(tmp_path, seed):
    neff, old = shared_cache(tmp_path)
    node_env = {"PATH": "", neuron.NODE_CACHE_VAR: str(tmp_path / "nc")}
    plan = neuron.TrialLaunch.prepare({"device": "neuron"}, 1, {}, str(tmp_path / "fsx"), node_env=node_env,
                                      private_cache=tmp_path / "art" / "neuron-cache", seed=seed)
    private = tmp_path / "art" / "neuron-cache" / "neff"
    assert plan.env[neuron.NEFF_CACHE_VAR] == str(private) and plan.env[neuron.NODE_CACHE_VAR] != str(tmp_path / "nc")
    seen = private / old.relative_to(neff)
    assert seen.read_bytes() == old.read_bytes() and seen.is_symlink() == (seed == "link")  # a hit for the trainer
    rename_into(seen, b"poison")  # the trainer replaces the shared entry in its own directory...
    new = private / "ef" / "01" / ("ef01" + "1" * 28 + ".neff")
    rename_into(new, b"graph compiled by this trial")  # ...and compiles a graph nobody has
    (private / "ef" / "01" / ".tmp.half").write_bytes(b"a write still in progress")
    attrs = plan.finished({"device": "neuron", "steps": 3}, 1.0, 2.0)
    assert old.read_bytes() == b"graph compiled by an earlier trial"
    assert (neff / new.relative_to(private)).read_bytes() == b"graph compiled by this trial"
    assert not list(neff.rglob(".*")) and not private.exists()  # no temporary file shared; the overlay gone
    assert attrs["graph_cache"] == "miss" and attrs["graph_cache_new_entries"] == 1
    assert (attrs["graph_cache_published"], attrs["graph_cache_refused"]) == (1, 1)
    assert attrs["compile_cache_private"] == seed


def test_a_private_cache_that_only_reads_is_a_hit_and_publishes_nothing(tmp_path):
    neff, old = shared_cache(tmp_path)
    plan = neuron.TrialLaunch.prepare({"device": "neuron"}, 1, {}, str(tmp_path / "fsx"),
                                      node_env={"PATH": "", neuron.NODE_CACHE_VAR: str(tmp_path / "nc")},
                                      private_cache=tmp_path / "art" / "neuron-cache", seed="link")
    attrs = plan.finished({"device": "neuron", "steps": 3}, 1.0, 2.0)
    assert attrs["graph_cache"] == "hit" and attrs["graph_cache_entries"] == 1
    assert (attrs["graph_cache_published"], attrs["graph_cache_refused"]) == (0, 0)
    assert [p.name for p in neff.rglob("*") if p.is_file()] == [old.name]


def test_publishing_never_replaces_an_entry_another_trial_published_first(tmp_path):
    neff, _ = shared_cache(tmp_path)
    first = neuron.overlay.Overlay(neff, tmp_path / "one", "copy")
    second = neuron.overlay.Overlay(neff, tmp_path / "two", "copy")
    first.seed(), second.seed()
    rename_into(tmp_path / "one" / "x" / "y" / "k.neff", b"first")
    rename_into(tmp_path / "two" / "x" / "y" / "k.neff", b"second")
    os.symlink("/etc/passwd", tmp_path / "two" / "x" / "y" / "link.neff")  # a link is never followed
    assert first.publish() == (1, 0) and second.publish() == (0, 0)
    assert (neff / "x" / "y" / "k.neff").read_bytes() == b"first" and not (neff / "x" / "y" / "link.neff").exists()


def test_a_bad_seed_setting_is_one_line():
    with pytest.raises(neuron.LaunchError, match=r"^SWEEP_NEFF_CACHE_SEED='hard': must be one of link, copy$"):
        neuron.overlay.seed_mode({"SWEEP_NEFF_CACHE_SEED": "hard"}, False)
    assert neuron.overlay.seed_mode({}, True) == "link" and neuron.overlay.seed_mode({}, False) == "copy"


def test_a_root_supervisor_publishes_as_the_shared_caches_owner(tmp_path):
    """A worker's supervisor is root; the node's cache is the service user's, which node_sync writes into."""
    from tests.ci import skip_unless_ci

    if os.geteuid() != 0:
        skip_unless_ci("giving a file to another user needs root")
    neff, _ = shared_cache(tmp_path)
    nobody = 65534
    for path in (neff, *neff.rglob("*")):
        os.chown(path, nobody, nobody)
    overlay = neuron.overlay.Overlay(neff, tmp_path / "private", "link")
    overlay.seed()
    rename_into(tmp_path / "private" / "ef" / "01" / "k.neff", b"new")
    assert overlay.publish() == (1, 0)
    for path in (neff / "ef", neff / "ef" / "01", neff / "ef" / "01" / "k.neff"):
        assert (path.stat().st_uid, path.stat().st_gid) == (nobody, nobody), path
    assert stat.S_IMODE((neff / "ef" / "01" / "k.neff").stat().st_mode) == 0o644

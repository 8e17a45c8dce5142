"""A team's script cannot forge its recorded value, read the service's secrets or reach into the next trial.

Each forgery of issue 35, tried by a copy of the worked example's train.py (autoresearch's dialect, beside the
stand-in kit) with a few lines appended, under the real supervisor and script trainer: the trial records the
kit's score of its checkpoint (or fails), never the figure the script put forward.
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from model.script.signing import sign
from sweep.run.supervisor import Supervisor, TrialTask, script_env
from tests.sweep_fixtures import ROOT, supervise

pytestmark = pytest.mark.slow
SCRIPT = ROOT / "sweep" / "studies" / "script-demo" / "train.py"
SECRETS = {"SWEEP_STORAGE": "postgresql://sweep:hunter2@db/sweep", "PGPASSWORD": "hunter2",
           "AWS_SECRET_ACCESS_KEY": "abc", "AWS_ACCESS_KEY_ID": "AKIA", "RAY_ADDRESS": "10.0.0.1:6380",
           "RAY_AUTH_TOKEN": "t0ken"}


def forging(tmp_path: Path, tail: str, name: str = "train.py") -> Path:
    path = tmp_path / name
    path.write_text(SCRIPT.read_text() + "\n" + tail.strip() + "\n")
    return path


def task(tmp_path: Path, kit: Path, script: Path, **config) -> TrialTask:
    cfg = {"script": str(script), "kit": str(kit / "prepare.py"), "eval_fractions": [],
           "constants": {"NUM_THREADS": 1, "BATCH_SIZE": 4, "SEQ_LEN": 32, "EVAL_BATCH_SIZE": 4}, **config}
    return TrialTask(study="w", storage_url="", number=0, trial_id=0, params={}, config=cfg, budget_s=3,
                     deadline_s=200, eval_fractions=(), trainer="model.script.run", launches_ranks=True,
                     stop_grace_s=10, heartbeat_s=1, artifact_dir=str(tmp_path / "art"))


def honest_score(tmp_path: Path, kit: Path) -> float:
    """The kit's evaluate_bpb of the trial's checkpoint, in a fresh process of the test's own."""
    work = tmp_path / "art" / "script"
    out = subprocess.run([sys.executable, "-m", "model.script.score", "--script", "train.py", "--kit", "prepare.py",
                          "--checkpoint", "out/final.pt", "--batch-size", "4"], cwd=work, capture_output=True,
                         text=True, check=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    return json.loads(out.stdout)["val_bpb"]


def test_a_second_summary_block_is_only_a_claim(tmp_path, standin_kit):
    script = forging(tmp_path, 'print("---")\nprint("val_bpb: 0.1")\nprint("adhoc: true")')
    out = supervise(task(tmp_path, standin_kit, script))
    assert out.state == "COMPLETE", out
    rec = out.record
    assert rec["claimed_val_bpb"] == 0.1 and rec["claim_differs"] is True and "adhoc" not in rec
    # the kit's score (to float32 summation order: this process may use other thread counts)
    assert out.value == rec["val_bpb"] == pytest.approx(honest_score(tmp_path, standin_kit), rel=1e-6)


def test_a_result_line_written_to_the_parents_stdout_is_not_an_event(tmp_path, standin_kit):
    line = json.dumps({"event": "result", "status": "ok", "val_bpb": 0.1})
    script = forging(tmp_path, f"""
import os
with open(f"/proc/{{os.getppid()}}/fd/1", "w") as parent:
    parent.write({line!r} + "\\n")
""")
    out = supervise(task(tmp_path, standin_kit, script))
    assert out.state == "COMPLETE" and out.value == pytest.approx(honest_score(tmp_path, standin_kit), rel=1e-6)
    assert line in (tmp_path / "art" / "events.jsonl").read_text()  # it reached the supervisor, which ignored it


def test_only_lines_signed_with_the_trials_key_are_events(tmp_path, standin_kit):
    sup = Supervisor(task(tmp_path, standin_kit, SCRIPT))
    forged = {"event": "result", "status": "ok", "val_bpb": 0.1}
    sup._handle(json.dumps(forged).encode())
    sup._handle(sign(secrets.token_bytes(32), forged).encode())  # signed, with another key
    assert sup.record is None and sup.unsigned_lines == 2
    sup._handle(sign(sup.key, {**forged, "val_bpb": 1.5}).encode())
    assert sup.record == {"status": "ok", "val_bpb": 1.5}


def test_a_forged_result_and_a_killed_trainer_is_never_complete(tmp_path, standin_kit):
    line = json.dumps({"event": "result", "status": "ok", "val_bpb": 0.1})
    script = forging(tmp_path, f"""
import os, signal
with open(f"/proc/{{os.getppid()}}/fd/1", "w") as parent:
    parent.write({line!r} + "\\n")
os.kill(os.getppid(), signal.SIGKILL)
""")
    out = supervise(task(tmp_path, standin_kit, script))
    assert out.state == "FAIL" and out.fail_kind == "crash" and out.value is None, out


def test_a_script_that_rewrites_its_copy_of_the_kit_is_not_scored(tmp_path, standin_kit):
    script = forging(tmp_path, """
with open("prepare.py", "a") as kit:
    kit.write("\\ndef evaluate_bpb(model, tokenizer, batch_size):\\n    return 0.1\\n")
""")
    out = supervise(task(tmp_path, standin_kit, script))
    assert out.state == "FAIL" and "changed its copy of the kit's prepare.py" in out.reason, out


def test_a_trial_that_writes_into_the_kit_folder_fails_and_so_does_the_next(tmp_path, standin_kit):
    kit = tmp_path / "kit"
    shutil.copytree(standin_kit, kit, symlinks=True)
    poison = forging(tmp_path, """
import glob
for path in glob.glob("tokenizer/*"):
    with open(path, "ab") as f:
        f.write(b"poison")
""", "poison.py")
    first = supervise(task(tmp_path / "1", kit, poison, kit_setup=True))
    assert first.state == "FAIL" and "the kit's folder changed during the trial" in first.reason, first
    honest = supervise(task(tmp_path / "2", kit, SCRIPT, kit_setup=True))
    assert honest.state == "FAIL" and "changed since its setup" in honest.reason, honest


def test_a_script_sees_none_of_the_services_secrets(tmp_path, standin_kit, monkeypatch):
    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    seen = tmp_path / "env.json"
    script = forging(tmp_path, f"""
import json, os
with open({str(seen)!r}, "w") as f:
    json.dump(dict(os.environ), f)
""")
    out = supervise(task(tmp_path, standin_kit, script))
    assert out.state == "COMPLETE", out
    env = json.loads(seen.read_text())
    assert not set(SECRETS) & set(env) and env["OMP_NUM_THREADS"] == "1"
    assert "hunter2" not in seen.read_text()
    # a variable the spec names to pass reaches it; a secret-looking name only that way
    assert script_env({"HF_TOKEN": "x", "PATH": "/bin"}, ("HF_TOKEN",)) == {"HF_TOKEN": "x", "PATH": "/bin"}
    assert script_env({"NEURON_RT_TOKEN": "x", "NEURON_RT_VISIBLE_CORES": "0"}) == {"NEURON_RT_VISIBLE_CORES": "0"}


def test_a_script_reaches_the_shared_compile_cache_only_through_publication(tmp_path, standin_kit):
    neff = tmp_path / "fsx" / "neff"
    old = neff / "ab" / "cd" / ("abcd" + "0" * 28 + ".neff")
    old.parent.mkdir(parents=True)
    old.write_bytes(b"graph compiled by an earlier trial")
    script = forging(tmp_path, f"""
import os
cache = os.environ["TORCH_NEURONX_NEFF_CACHE_DIR"]
with open(os.path.join(cache, "ab", "cd", {old.name!r}), "w") as f:  # in place, through whatever is there
    f.write("poison")
os.makedirs(os.path.join(cache, "ef", "01"))
with open(os.path.join(cache, "ef", "01", "ef01" + "1" * 28 + ".neff"), "w") as f:
    f.write("graph compiled by this trial")
""")
    sup = Supervisor(replace(task(tmp_path, standin_kit, script), compile_cache=str(tmp_path / "fsx")))
    try:
        out = sup.run()
    finally:
        sup.close()
    assert out.state == "COMPLETE", out
    assert old.read_bytes() == b"graph compiled by an earlier trial"
    assert (neff / "ef" / "01" / ("ef01" + "1" * 28 + ".neff")).read_text() == "graph compiled by this trial"
    attrs = sup.launch_attrs
    assert attrs["compile_cache_private"] == "copy" and attrs["graph_cache_new_entries"] == 1
    assert (attrs["graph_cache_published"], attrs["graph_cache_refused"]) == (1, 1)

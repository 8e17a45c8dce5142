"""A script trial runs as a user of its own (``[trial] run_as``, the node's ``SWEEP_TRIAL_USER``): it cannot read
the service's token or the environment of the processes above it, nor write the kit or the shared compile cache,
and it still completes and is scored.

The trial user here is ``nobody`` (uid 65534, on every Debian and Ubuntu system), so the tests change no user
database. Starting a process as another user needs root: CI runs as root; elsewhere these cases skip
(docs/testing.md). This machine's interpreter may sit under a folder ``nobody`` cannot search (pyenv under
``/root``): the fixture lets it search (never list) those folders for the module's run and restores their modes.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import sys
import sysconfig
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest

from sweep.run.supervisor import Supervisor, TrialTask
from sweep.run.trialuser import USER_VAR, TrialUser
from tests.ci import skip_unless_ci
from tests.sweep.run.test_forgery import SCRIPT, honest_score
from tests.sweep_fixtures import ROOT, supervise

pytestmark = pytest.mark.slow
NOBODY = "nobody"


@pytest.fixture(scope="module")
def nobody():
    """``nobody``, able to search its way to the interpreter, its library and the checkout."""
    if os.geteuid() != 0:
        skip_unless_ci("starting a trial as another user needs root")
    user = TrialUser.resolve(NOBODY)
    opened: list[tuple[Path, int]] = []
    for path in (os.path.realpath(sys.executable), sysconfig.get_path("stdlib"), sys.prefix, str(ROOT)):
        for folder in reversed(Path(os.path.realpath(path)).parents):
            st = os.stat(folder)
            if not user.allows(st, os.X_OK):
                opened.append((folder, stat.S_IMODE(st.st_mode)))
                os.chmod(folder, stat.S_IMODE(st.st_mode) | stat.S_IXOTH)
    try:
        yield user
    finally:
        for folder, mode in reversed(opened):
            os.chmod(folder, mode)


@pytest.fixture
def place():
    """A folder every user may search (pytest's own is root's alone), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="trnsweep-trial-user-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def script_task(where: Path, kit: Path, script: Path, **fields) -> TrialTask:
    cfg = {"script": str(script), "kit": str(kit / "prepare.py"), "eval_fractions": [],
           "constants": {"NUM_THREADS": 1, "BATCH_SIZE": 4, "SEQ_LEN": 32, "EVAL_BATCH_SIZE": 4}}
    return TrialTask(study="w", storage_url="", number=0, trial_id=0, params={}, config=cfg, budget_s=3,
                     deadline_s=200, eval_fractions=(), trainer="model.script.run", launches_ranks=True,
                     stop_grace_s=10, heartbeat_s=1, artifact_dir=str(where / "art"), **fields)


def test_a_trial_of_its_own_user_reaches_no_secret_kit_or_shared_cache_and_is_scored(nobody, place, standin_kit):
    kit = place / "kit"
    shutil.copytree(standin_kit, kit)  # root's, as a node's kit folder is the service's
    token = place / "ray" / "auth_token"  # stands in for ~/.ray/auth_token: the service's, 0600
    token.parent.mkdir()
    token.write_text("ray-token")
    token.chmod(0o600)
    neff = place / "cache" / "neff"
    old = neff / "ab" / "cd" / ("abcd" + "0" * 28 + ".neff")
    old.parent.mkdir(parents=True)
    old.write_bytes(b"graph compiled by an earlier trial")
    script = place / "train.py"
    script.write_text(SCRIPT.read_text() + f"""
import json, os


def attempt(what):
    try:
        what()
    except OSError as e:
        return type(e).__name__
    return "done"


def append(path):
    with open(path, "a") as f:
        f.write("poison")


def forge():  # after training, as a forging script would; the scorer runs none of it
    cache = os.environ["TORCH_NEURONX_NEFF_CACHE_DIR"]
    tokenizer = os.path.realpath("tokenizer")
    seen = {{
        "uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(), "home": os.environ.get("HOME"),
        "token": attempt(lambda: open({str(token)!r}).read()),
        "trainer environ": attempt(lambda: open(f"/proc/{{os.getppid()}}/environ", "rb").read()),
        "supervisor environ": attempt(lambda: open("/proc/{os.getpid()}/environ", "rb").read()),
        "kit prepare.py": attempt(lambda: append({str(kit / "prepare.py")!r})),
        "kit new file": attempt(lambda: append(os.path.join(os.path.dirname(tokenizer), "planted.pkl"))),
        "kit tokenizer": attempt(lambda: [append(os.path.join(tokenizer, n)) for n in os.listdir(tokenizer)]),
        "shared cache entry": attempt(lambda: append(os.path.join(cache, "ab", "cd", {old.name!r}))),
    }}
    os.makedirs(os.path.join(cache, "ef", "01"))
    with open(os.path.join(cache, "ef", "01", "ef01" + "1" * 28 + ".neff"), "w") as f:
        f.write("graph compiled by this trial")
    os.symlink({str(token)!r}, "../result.json")  # for the supervisor to write through, were it to follow it
    with open("seen.json", "w") as f:
        json.dump(seen, f)


forge()
""")
    kit_before = {p.name: p.read_bytes() for p in kit.rglob("*") if p.is_file()}
    sup = Supervisor(script_task(place, kit, script, run_as=NOBODY, compile_cache=str(place / "cache")))
    try:
        out = sup.run()
    finally:
        sup.close()
    assert out.state == "COMPLETE", out
    # the scorer's figure, computed as nobody, is the kit's score of the checkpoint
    work = place / "art" / "script"
    assert out.value == pytest.approx(honest_score(place, kit), rel=1e-6)
    seen = json.loads((work / "seen.json").read_text())
    assert (seen["uid"], seen["gid"]) == (nobody.uid, nobody.gid) and 0 not in seen["groups"]
    assert seen["home"] == str(place / "art")
    for what in ("token", "trainer environ", "supervisor environ", "kit prepare.py", "kit new file",
                 "kit tokenizer", "shared cache entry"):
        assert seen[what] == "PermissionError", (what, seen[what])
    assert {p.name: p.read_bytes() for p in kit.rglob("*") if p.is_file()} == kit_before
    assert token.read_text() == "ray-token"
    # the shared cache: the entry as it was, the trial's new graph published (through links: it is another user)
    assert old.read_bytes() == b"graph compiled by an earlier trial"
    assert (neff / "ef" / "01" / ("ef01" + "1" * 28 + ".neff")).read_text() == "graph compiled by this trial"
    attrs = sup.launch_attrs
    assert attrs["trial_user"] == NOBODY and attrs["compile_cache_private"] == "link"
    assert (attrs["graph_cache_published"], attrs["graph_cache_refused"]) == (1, 0)
    # the folder is the service's again, and the planted link is gone
    for path in (place / "art", work, work / "seen.json", work / "out" / "final.pt"):
        assert os.lstat(path).st_uid == 0, path
    assert not (place / "art" / "result.json").is_symlink()


def test_an_unknown_trial_user_is_a_config_failure_in_one_line(tmp_path, monkeypatch, standin_kit):
    out = supervise(script_task(tmp_path, standin_kit, SCRIPT, run_as="no-such-trnsweep-user"))
    assert (out.state, out.fail_kind) == ("FAIL", "config") and "\n" not in out.reason
    assert out.reason == "trial user: run_as: no user 'no-such-trnsweep-user' on this node"
    monkeypatch.setenv(USER_VAR, "another-missing-user")  # the node's, where the spec names none
    out = supervise(script_task(tmp_path, standin_kit, SCRIPT))
    assert out.fail_kind == "config" and "'another-missing-user'" in out.reason


def test_a_trial_user_who_cannot_reach_its_folder_is_a_config_failure(nobody, tmp_path, standin_kit):
    blocked = tmp_path / "blocked"
    blocked.mkdir(mode=0o700)
    out = supervise(script_task(blocked, standin_kit, SCRIPT, run_as=NOBODY))
    assert (out.state, out.fail_kind) == ("FAIL", "config"), out
    assert out.reason.startswith("trial user: nobody cannot reach what the trial needs: ")
    assert "is not searchable by nobody" in out.reason and "\n" not in out.reason


def test_the_kit_is_set_up_as_the_service_before_a_trial_of_another_user(nobody, place, standin_kit):
    kit = place / "kit"
    shutil.copytree(standin_kit, kit)
    task = script_task(place, kit, SCRIPT, run_as=NOBODY)
    out = supervise(replace(task, config={**task.config, "kit_setup": True}))
    assert out.state == "COMPLETE", out
    assert (kit / ".kit-ready").stat().st_uid == 0 and pwd.getpwuid(os.stat(kit).st_uid).pw_name == "root"

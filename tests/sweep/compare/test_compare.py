"""``python -m sweep compare``: bad sides refused in one line, and a real comparison of the worked example's
train.py with a copy that changes one constant, on a local Ray of two nodes, killed midway and resumed.

The comparison's trials run through the sweep's own driver, Ray tasks, supervisor and script trainer on
real text (the stand-in kit); the report is validated against sweep/compare/schema.json.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
from pathlib import Path

import jsonschema
import optuna
import pytest
from optuna_dashboard import get_note

from sweep import cli
from sweep import store as st
from sweep.compare.report import SCHEMA_PATH
from tests.ray_head import session_members
from tests.sweep_fixtures import ROOT, environ, load_trials, sweep_cmd, sweep_env, wait_for, write_spec

SCRIPT = ROOT / "sweep" / "studies" / "script-demo" / "train.py"
KIT_SCRIPT = ROOT / "sweep" / "studies" / "kit-demo" / "train.py"


def sections(kit: Path) -> dict:
    return {"study": {"n_trials": 1, "seed": 1},
            "trial": {"script": str(SCRIPT), "kit": str(kit / "prepare.py"), "budget_s": 2,
                      "startup_allowance_s": 60, "eval_timeout_s": 60, "heartbeat_s": 2, "stale_after_s": 30,
                      "stop_grace_s": 10},
            "trial.resources": {"num_cpus": 1}, "pruner": {"name": "none"},
            "fixed": {"num_threads": 1, "batch_size": 4, "seq_len": 32, "eval_batch_size": 4}}


def candidate(directory: Path) -> Path:
    """The worked example with one constant changed (what compare-demo tries)."""
    text = SCRIPT.read_text()
    changed, n = re.subn(r"(?m)^LEARNING_RATE = .*$", "LEARNING_RATE = 0.01", text)
    assert n == 1
    path = directory / "cand" / "train.py"
    path.parent.mkdir()
    path.write_text(changed)
    return path


@pytest.mark.parametrize("sides, words", [
    (["{missing}/nope.py", "{cand}"], "base {missing}/nope.py: no such script"),
    (["{script}", str(KIT_SCRIPT)], "written in the kit dialect, the spec's script in the autoresearch dialect"),
    (["{script}", "[1, 2]"], "cand [1, 2]: parameters are a JSON object, got list"),
    (["{script}", "nope#x"], "cand nope#x: STUDY#N takes a trial number, got 'x'"),
    (["{script}", "{cand}", "--confirm"], "--eval-tokens and --confirm set the kit's eval-public evaluation"),
    (["{script}", "{cand}", "--alpha", "0.7"], "argument --alpha: must be a number between 0 and 0.5, got '0.7'"),
])
def test_a_bad_side_or_option_exits_2_in_one_line_before_anything_runs(standin_kit, tmp_path, capsys, sides, words):
    spec = write_spec(tmp_path, "cmp", sections(standin_kit))
    cand = candidate(tmp_path)
    fill = {"missing": str(tmp_path), "cand": str(cand), "script": str(SCRIPT)}
    argv = ["compare", *(s.format(**fill) if s.startswith("{") else s for s in sides), "--spec", str(spec)]
    where = {"SWEEP_STORAGE": f"journal:{tmp_path / 'j.log'}", "SWEEP_ARTIFACTS": str(tmp_path / "art")}
    with environ(where), pytest.raises(SystemExit) as e:  # argparse's own errors exit too
        raise SystemExit(cli.main(argv, out=io.StringIO()))
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2, err
    assert len(err.splitlines()) == 1 and words.format(**fill) in err, err
    assert not (tmp_path / "art").exists()  # nothing ran


@pytest.mark.slow
def test_a_comparison_pairs_seeds_on_nodes_and_resumes_after_a_kill_without_rerunning_finished_pairs(
        standin_kit, tmp_path):
    spec = write_spec(tmp_path, "cmp", sections(standin_kit))
    cand = candidate(tmp_path)
    storage = f"journal:{tmp_path / 'j.log'}"
    env = sweep_env(storage, tmp_path / "art")
    args = sweep_cmd("compare", str(SCRIPT), str(cand), "--spec", str(spec), "--local-nodes", "2",
                     "--max-runs", "4", "--min-effect", "0.01", "--name", "cmp-demo")
    log = open(tmp_path / "first.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(args, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        def two_done() -> bool:
            assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            return sum(t.state.name == "COMPLETE" for t in load_trials(storage, "cmp-demo", missing_ok=True)) >= 2

        wait_for(two_done, 300, interval=0.5, what="two finished runs")
    finally:  # killed midway: the driver, its local Ray and every trial, all of its own session
        for pid in session_members(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.wait()
        wait_for(lambda: not session_members(proc.pid), 30, what="the killed comparison's processes to be gone")
        log.close()
    address = re.search(r"local cluster of 2 one-CPU nodes at (\S+)", (tmp_path / "first.log").read_text())
    _forget(address[1] if address else None)
    before = {t.number: (t.params["pair"], t.params["side"]) for t in load_trials(storage, "cmp-demo")
              if t.state.name == "COMPLETE"}
    assert len(before) >= 2
    done_pairs = {p for p, _ in before.values() if sum(q == p for q, _ in before.values()) == 2}

    second = subprocess.run([*args, "--json"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600,
                            start_new_session=True)
    _forget(m[1] if (m := re.search(r"local cluster of 2 one-CPU nodes at (\S+)", second.stderr)) else None)
    assert second.returncode == 0, second.stderr[-3000:]
    rep = json.loads(second.stdout)
    jsonschema.validate(rep, json.loads(SCHEMA_PATH.read_text()))
    trials = load_trials(storage, "cmp-demo")
    for t in trials:  # the finished runs are kept as they were, and no finished pair ran again; a half-done
        # pair's finished side ran again only because its node is gone (a new local Ray has new nodes)
        if t.number in before:
            assert t.state.name == "COMPLETE"
        else:
            assert t.params["pair"] not in done_pairs, t.number
    for t in trials:  # what was running at the kill ended lost, and its side ran again: same pair, seed, side
        if t.state.name == "FAIL":
            assert t.user_attrs.get("fail_kind") in ("lost", "infra"), t.user_attrs.get("fail_reason")
            again = [u for u in trials if u.number > t.number and u.params == t.params]
            assert again and again[-1].state.name == "COMPLETE", t.number
    assert rep["verdict"] in ("ADOPT", "DISCARD", "UNDECIDED"), rep["candidates"][0]["stages"][-1]["reason"]
    assert rep["runs_used"] == sum(t.state.name in ("COMPLETE", "FAIL", "PRUNED") for t in trials)
    nodes = set()
    for p in rep["pairs"]:
        runs = p["runs"]
        assert set(runs) <= {"base", "cand"}
        assert {r["node"] for r in runs.values()} == {runs["base"]["node"]}, p  # both sides on the pair's node
        assert {t.params["seed"] for t in trials if t.params["pair"] == p["pair"]} == {p["seed"]}
        nodes.add(runs["base"]["node"])
    assert len(nodes) == 2, nodes  # pairs ran on both nodes
    assert rep["candidates"][0]["stages"][0]["pairs_used"] + len(rep["candidates"][0]["stages"][0]["excluded"]) \
        <= len(rep["pairs"])
    study = optuna.load_study(study_name="cmp-demo", storage=st.open_storage(storage))
    note = get_note(study)  # the dashboard's view: the verdict, the interval at each look, every pair
    assert f"## cand: **{rep['verdict']}**" in note and "the interval as it narrowed" in note, note
    assert all(f"| {p['pair']} | {p['seed']} | base |" in note for p in rep["pairs"]), note
    # The report is the study's: asked again, the finished comparison prints it without running anything.
    third = subprocess.run([*args, "--json"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
                           start_new_session=True)
    assert third.returncode == 0, third.stderr[-2000:]
    assert json.loads(third.stdout)["pairs"] == rep["pairs"]
    assert len(load_trials(storage, "cmp-demo")) == len(trials)


def _forget(address: str | None) -> None:
    """A killed local cluster leaves its address where a later ``ray.init()`` without one would look."""
    current = Path("/tmp/ray/ray_current_cluster")
    if address and current.exists() and current.read_text().strip() == address:
        current.unlink()


def test_drift_alarms_scale_with_the_noise_the_comparison_states():
    from sweep.compare.report import drift

    controls = [("a", 0, 2.84676), ("a", 2, 2.83120), ("b", 1, 2.83817), ("b", 3, 2.84714)]
    assert len(drift(controls, 0.0007)) == 2  # a trn2 screen's noise: 0.016 and 0.009 apart are drift
    assert drift(controls, 0.01) == []  # a laptop's stated noise: the same spread is seed noise
    assert len(drift([("a", 0, 2.80), ("a", 0, 2.90)], 0.01)) == 1  # the same seed 0.1 apart still alarms


def _record(study, pair: int, side: str, value: float, node: str = "node-a", steps: int = 300) -> None:
    """A finished run of a comparison, as the driver stores one (real Optuna trials, no run)."""
    from optuna.distributions import CategoricalDistribution, IntDistribution
    from optuna.trial import create_trial

    dists = {"side": CategoricalDistribution(["base", "cand1", "cand2"]), "pair": IntDistribution(0, 32),
             "seed": IntDistribution(0, 64)}
    study.add_trial(create_trial(params={"side": side, "pair": pair, "seed": pair}, distributions=dists,
                                 value=value, user_attrs={"num_steps": steps, "compare_node": node}))


def test_two_candidates_share_the_base_and_a_decided_one_leaves_the_next_pairs(standin_kit, tmp_path):
    from sweep.compare.decision import Rule
    from sweep.compare.plan import plan
    from sweep.compare.report import report
    from sweep.compare.run import CompareDriver

    spec = write_spec(tmp_path, "cmp", sections(standin_kit))
    cand = candidate(tmp_path)
    where = {"SWEEP_STORAGE": f"journal:{tmp_path / 'j.log'}", "SWEEP_ARTIFACTS": str(tmp_path / "art")}
    with environ(where):
        from sweep.spec import load

        p = plan(load(spec), str(SCRIPT), [str(cand), '{}'], Rule(noise_sd=0.001), name="two")
    assert p.labels == ("base", "cand1", "cand2")
    study = optuna.create_study(study_name="two", direction="minimize")
    for pair, node in ((0, "node-a"), (1, "node-b")):  # cand1 clearly better, cand2 no different
        _record(study, pair, "base", 2.85 + 0.0001 * pair, node)
        _record(study, pair, "cand1", 2.80 + 0.0001 * pair, node)
        _record(study, pair, "cand2", 2.8499 + 0.0001 * pair, node)
    rep = report(p, study)
    jsonschema.validate(rep, json.loads(SCHEMA_PATH.read_text()))
    by = {c["label"]: c for c in rep["candidates"]}
    assert by["cand1"]["verdict"] == "ADOPT" and by["cand2"]["verdict"] == "CONTINUE", rep["candidates"]
    assert rep["verdict"] == "CONTINUE" and rep["runs_used"] == 6
    driver = CompareDriver(p)
    work = driver._work(study.get_trials(), ["node-a-full", "node-b-full"], free=2)
    assert [w[0]["pair"] for w in work] == [2, 3] and all(w[1] is None for w in work)  # new pairs, any node
    assert {w[0]["side"] for w in work} <= {"base", "cand2"}  # cand1 is decided: its pairs are over
    assert set(driver._sides(2, "screen", {"cand2": "screen"}, {})) == {"base", "cand2"}


def test_an_adopted_candidate_is_confirmed_at_the_confirmation_size_and_that_verdict_is_final(tmp_path):
    """--confirm (kit dialect): after the screen adopts, new pairs run the confirmation sides, whose trainer
    config evaluates promote_eval_tokens; the candidate's verdict is then the confirmation's."""
    from sweep.compare.decision import Rule
    from sweep.compare.plan import plan
    from sweep.compare.report import report
    from sweep.compare.run import CompareDriver
    from sweep.spec import load

    demo = ROOT / "sweep" / "studies" / "kit-demo"
    trial = {"script": str(demo / "train.py"), "kit": str(demo / "prepare.py"), "budget_s": 6, "eval_tokens": 8192,
             "promote_eval_tokens": 65536, "seed_knob": "--seed", "startup_allowance_s": 60, "eval_timeout_s": 60}
    spec = write_spec(tmp_path, "kitcmp", {"study": {"n_trials": 1}, "trial": trial, "pruner": {"name": "none"}})
    with environ({"SWEEP_STORAGE": f"journal:{tmp_path / 'j.log'}", "SWEEP_ARTIFACTS": str(tmp_path / "art")}):
        p = plan(load(spec), trial["script"], ['{}'], Rule(), name="conf", confirm=True)
    assert p.spec.trainer_config({"side": "base", "pair": 0, "seed": 0})["eval_tokens"] == 8192
    assert p.spec.trainer_config({"side": "cand@confirm", "pair": 2, "seed": 2})["eval_tokens"] == 65536
    assert p.spec.trainer_config({"side": "cand@confirm", "pair": 2, "seed": 2})["seed"] == 2

    study = optuna.create_study(study_name="conf", direction="minimize")
    from optuna.distributions import CategoricalDistribution, IntDistribution
    from optuna.trial import create_trial

    dists = {"side": CategoricalDistribution(["base", "cand", "base@confirm", "cand@confirm"]),
             "pair": IntDistribution(0, 64), "seed": IntDistribution(0, 64)}

    def run(pair: int, side: str, value: float) -> None:
        study.add_trial(create_trial(params={"side": side, "pair": pair, "seed": pair}, distributions=dists,
                                     value=value, user_attrs={"num_steps": 300, "compare_node": "node-a"}))

    for pair in (0, 1):  # the screen: a clear gain
        run(pair, "base", 0.9700 + 0.0001 * pair)
        run(pair, "cand", 0.9650 + 0.0001 * pair)
    work = CompareDriver(p)._work(study.get_trials(), ["node-a-1"], free=1)
    assert [(w[0]["pair"], w[0]["side"].endswith("@confirm")) for w in work] == [(2, True)]
    assert report(p, study)["verdict"] == "CONTINUE"  # adopted at the screen, not yet confirmed
    for pair in (2, 3):  # the confirmation at 20M: the candidate is worse
        run(pair, "base@confirm", 0.9770 + 0.0001 * pair)
        run(pair, "cand@confirm", 0.9775 + 0.0001 * pair)
    rep = report(p, study)
    jsonschema.validate(rep, json.loads(SCHEMA_PATH.read_text()))
    stages = {s["stage"]: s for s in rep["candidates"][0]["stages"]}
    assert stages["screen"]["verdict"] == "ADOPT" and stages["confirm"]["verdict"] == "DISCARD"
    assert rep["verdict"] == "DISCARD" and stages["confirm"]["eval_tokens"] == 65536
    assert stages["screen"]["estimate"]["base"] is None  # 8,192 tokens: no known offset to the official score

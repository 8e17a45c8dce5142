"""optuna-dashboard over a real sweep: its HTTP API, trial artifacts through it, a headless Chromium, and a
``sweep dashboard`` process that keeps the storage password to itself."""

from __future__ import annotations

import gzip
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest

from sweep import cli, dashboard
from sweep import store as st
from sweep.run import notes
from sweep.spec import spec_hash
from sweep.store import artifacts as art
from tests.sweep_fixtures import (
    ROOT,
    head_env,
    pg_available,
    pg_database,
    run_sweep,
    sweep_cmd,
    sweep_env,
    tiny_spec,
    write_spec,
)

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SHOTS = os.environ.get("SWEEP_DASHBOARD_SHOTS")  # where the screenshots are kept for a look; else the test's tmp
NO_CHROMIUM = pytest.mark.skipif(not Path(CHROMIUM).exists() and not os.environ.get("CI"),
                                 reason="no chromium here (apt-get install chromium); CI must have it")
TRIAL = {"budget_s": 3, "startup_allowance_s": 30, "eval_timeout_s": 30, "eval_fractions": [0.5], "heartbeat_s": 1,
         "stale_after_s": 10, "stop_grace_s": 5}


@pytest.fixture(scope="module")
def swept(tmp_path_factory, data_cache, ray_cluster):
    """A real two-trial sweep (the session's Ray head, the real trainer), its journal and its artifacts."""
    d = tmp_path_factory.mktemp("dash")
    url = st.resolve_url(f"journal:{d / 'j.log'}")
    spec = write_spec(d, "dash", tiny_spec(data_cache, study={"n_trials": 2, "concurrency": 2, "seed": 5},
                                           trial=TRIAL))
    proc = run_sweep("run", str(spec), env=head_env(ray_cluster, url, d / "art"), timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return SimpleNamespace(url=url, art=str(d / "art"), spec=spec, name="dash", dir=d)


@pytest.fixture(scope="module")
def server(swept):
    with dashboard.running(swept.url, swept.art) as base:
        yield base


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _json(url: str) -> dict:
    status, body = _get(url)
    assert status == 200, (url, status, body[:500])
    return json.loads(body)


def _study_id(base: str, name: str) -> int:
    (s,) = [s for s in _json(f"{base}/api/studies")["study_summaries"] if s["study_name"] == name]
    return s["study_id"]


def _attrs(trial: dict) -> dict:
    return {a["key"]: a["value"] for a in trial["user_attrs"]}


def test_api_lists_the_study_its_trials_and_their_learning_curves(swept, server):
    sid = _study_id(server, swept.name)
    detail = _json(f"{server}/api/studies/{sid}")
    assert detail["objective_names"] == ["val_bpb"]
    trials = detail["trials"]
    assert [t["number"] for t in trials] == [0, 1] and {t["state"] for t in trials} == {"Complete"}
    for t in trials:
        curve = {p["step"]: p["value"] for p in t["intermediate_values"]}
        assert sorted(curve) == [2, 3]  # charged seconds: the eval at 1.5 s -> 2, the final value at 3
        assert curve[3] == t["values"][0]
        attrs = _attrs(t)
        for key in ("git_commit", "spec_hash", "tokens_per_second", "steps", "startup_seconds", "train_seconds",
                    "device", "val_bpb"):
            assert key in attrs, key
        assert attrs["spec_hash"] == spec_hash(swept.spec)
        assert attrs["environment"] == "latest-sdk"  # the spec's profile, recorded with every trial
        assert re.fullmatch(r"[0-9a-f]{40}", attrs["git_commit"])
        assert {p["name"] for p in t["params"]} == {"depth", "model_dim", "matrix_lr"}
    for t in trials:  # each trial's note: its headline figures, above everything else on its page
        note = t["note"]["body"]
        assert note.startswith(f"### Trial {t['number']}: COMPLETE\n"), note
        assert "| val_bpb | tokens/s | steps | MFU | charged s | params | git commit |" in note
        assert f"`{_attrs(t)['git_commit'][:10]}" in note and f"| {t['values'][0]:.4f} |" in note
    best = min(trials, key=lambda t: t["values"][0])
    summary = detail["note"]["body"]  # the study's: its best trials, the best first, and what to run next
    assert summary.startswith("## Best trials\n") and f"--trial {best['number']} " in summary
    assert summary.index(f"[{best['number']}]") < summary.index(f"[{1 - best['number']}]")
    figures = {g["id"]: json.loads(g["graph_object"]) for g in detail["plotly_graph_objects"]}
    assert set(figures) == {notes.TABLE_ID, notes.FIGURE_ID}  # on the study's page: its best trials, their curves
    layout = figures[notes.FIGURE_ID]["layout"]
    assert layout["xaxis"]["title"]["text"] == "charged seconds" and layout["yaxis"]["title"]["text"] == "val_bpb"
    assert _get(f"{server}/api/studies/{sid}/param_importances")[0] == 200
    status, body = _get(f"{server}/api/studies/{sid}/plot/slice")  # drawn by plotly on the server
    assert status == 200 and b"data" in body


def test_trial_artifacts_are_listed_and_downloadable(swept, server):
    sid = _study_id(server, swept.name)
    trials = _json(f"{server}/api/studies/{sid}")["trials"]
    best = min(trials, key=lambda t: t["values"][0])
    for t in trials:
        metas = {a["filename"]: a for a in t["artifacts"]}
        assert {"config.json", "trainer.log", "events.jsonl", "result.json"} <= set(metas)
        work = Path(swept.art) / swept.name / str(t["number"])
        for name, meta in metas.items():
            status, body = _get(f"{server}/artifacts/{sid}/{t['trial_id']}/{meta['artifact_id']}")
            assert status == 200, name
            assert body == (work / name).read_bytes(), name
        result = json.loads(_get(f"{server}/artifacts/{sid}/{t['trial_id']}/{metas['result.json']['artifact_id']}")[1])
        assert result["status"] == "ok" and result["val_bpb"] == t["values"][0]
        if t is best:
            assert "final.pt" in metas  # the study's best trial always carries its checkpoint
    assert _get(f"{server}/artifacts/{sid}/{trials[0]['trial_id']}/00000000-0000-0000-0000-000000000000")[0] == 404


def _raw(base: str, path: str, headers: dict[str, str] | None = None) -> http.client.HTTPResponse:
    """One request, redirects not followed."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("GET", path, headers=headers or {})
    return conn.getresponse()


def test_the_trial_table_address_leads_to_the_table_it_became(swept, server):
    sid = _study_id(server, swept.name)
    r = _raw(server, f"/dashboard/studies/{sid}/trialTable")
    assert r.status == 302 and r.getheader("Location") == f"/dashboard/studies/{sid}/smartSelection"
    page = _raw(server, f"/dashboard/studies/{sid}/trials", {"If-Modified-Since": "Tue, 01 Dec 2099 00:00:00 GMT"})
    body = page.read()  # the app's page, whole (never a 304 for a copy without our style), one line per cell
    assert page.status == 200 and dashboard.CELL_STYLE.encode() in body and b"bundle.js" in body
    assert int(page.getheader("Content-Length")) == len(body)


def test_the_served_bundle_names_the_curve_charts_axes(server):
    for headers in ({}, {"Accept-Encoding": "gzip, deflate"}):
        r = _raw(server, "/static/bundle.js", headers)
        body = r.read()
        assert r.status == 200 and r.getheader("Content-Type") == "application/javascript"
        if headers:
            assert r.getheader("Content-Encoding") == "gzip"
            body = gzip.decompress(body)
        text = body.decode()
        assert dashboard.AXES_OURS in text and dashboard.AXES_0_21 not in text
        assert 'title:"charged seconds"' in text
    etag = r.getheader("ETag")
    assert _raw(server, "/static/bundle.js", {"If-None-Match": etag}).status == 304


def test_a_bundle_without_the_known_text_is_served_as_it_is(tmp_path):
    other = tmp_path / "bundle.js"
    other.write_text('xaxis:{title:"Step"}')
    calls = []
    mended = dashboard.Mended(lambda env, start: calls.append(env["PATH_INFO"]) or [b"inner"], bundle=other)
    assert mended({"REQUEST_METHOD": "GET", "PATH_INFO": "/static/bundle.js"}, lambda *a: None) == [b"inner"]
    assert calls == ["/static/bundle.js"] and mended.patched is False


def _chromium(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=15000",
                           f"--user-data-dir={tmp_path / 'chromium'}", *args], capture_output=True, text=True,
                          timeout=120)


def _text(html: str) -> str:
    html = re.sub(r"<(script|style)\b.*?</\1>", " ", html, flags=re.S)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


def _main(html: str) -> str:
    """The page's content, the part right of the side bar (MUI's <main>): what a blank page lacks."""
    m = re.search(r"<main\b.*?</main>", html, flags=re.S)
    assert m, "no <main>: the app did not render at all"
    return m.group(0)


def _shoot(server: str, path: str, name: str, tmp_path: Path, size: str = "1400,1000") -> Path:
    shots = Path(SHOTS) if SHOTS else tmp_path
    shots.mkdir(parents=True, exist_ok=True)
    png = shots / f"{name}.png"
    png.unlink(missing_ok=True)
    shot = _chromium(f"--screenshot={png}", f"--window-size={size}", f"{server}{path}", tmp_path=tmp_path)
    assert shot.returncode == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", shot.stderr[-2000:]
    assert png.stat().st_size > 20_000  # a rendered page, not a blank one
    return png


@NO_CHROMIUM
def test_headless_chromium_renders_the_study_and_its_trials(swept, server, tmp_path):
    sid = _study_id(server, swept.name)
    page = _chromium("--dump-dom", f"{server}/dashboard/studies/{sid}/trials", tmp_path=tmp_path)
    assert page.returncode == 0, page.stderr[-2000:]
    text = _text(page.stdout)
    assert f"{swept.name} (id={sid})" in text
    assert "Trial 0" in text and "Trial 1" in text
    for word in ("Intermediate Values", "git_commit", "spec_hash", "tokens_per_second", "result.json", "trainer.log"):
        assert word in text, word

    overview = _text(_chromium("--dump-dom", f"{server}/dashboard/studies/{sid}", tmp_path=tmp_path).stdout)
    assert "val_bpb" in overview and "Best Trial" in overview
    # The study's own summary and figure, and the curve chart's axes as the sweep means them.
    assert "Best trials" in overview and "val_bpb against charged seconds" in overview
    assert overview.count("charged seconds") >= 3 and "Objective Value" not in overview

    _shoot(server, f"/dashboard/studies/{sid}", f"dashboard-{swept.name}", tmp_path, size="1400,2400")
    _shoot(server, f"/dashboard/studies/{sid}/trials", f"dashboard-{swept.name}-trials", tmp_path)


@NO_CHROMIUM
def test_headless_chromium_shows_a_trials_headline_figures_first(swept, server, tmp_path):
    sid = _study_id(server, swept.name)
    trial = _json(f"{server}/api/studies/{sid}")["trials"][1]
    path = f"/dashboard/studies/{sid}/trials?numbers=1"
    page = _chromium("--dump-dom", f"{server}{path}", tmp_path=tmp_path)
    assert page.returncode == 0, page.stderr[-2000:]
    main = _text(_main(page.stdout))
    assert len(main) > 1000, main  # an empty page has a title and a side bar, no more
    note = main[main.index("Trial 1: COMPLETE"):]
    for word in ("val_bpb", "tokens/s", "steps", "MFU", "charged s", "git commit",
                 _attrs(trial)["git_commit"][:10], f"{trial['values'][0]:.4f}"):
        assert word in note, word
    assert main.index("Trial 1: COMPLETE") < main.index("User Attributes")  # the figures come first
    _shoot(server, path, f"dashboard-{swept.name}-trial", tmp_path)


@NO_CHROMIUM
def test_headless_chromium_renders_the_trial_tables_rows(swept, server, tmp_path):
    sid = _study_id(server, swept.name)
    path = f"/dashboard/studies/{sid}/trialTable"
    page = _chromium("--dump-dom", f"{server}{path}", tmp_path=tmp_path)
    assert page.returncode == 0, page.stderr[-2000:]
    main = _main(page.stdout)
    rows = re.findall(r"<tr\b.*?</tr>", main, flags=re.S)
    cells = [re.findall(r"<td\b.*?</td>", r, flags=re.S) for r in rows]
    body = [c for c in cells if c]
    assert len(body) == 2, f"{len(rows)} rows: the trial table is empty"  # one per trial
    text = _text(main)
    for word in ("Number", "State", "val_bpb", "git_commit", "tokens_per_second"):
        assert word in text, word
    _shoot(server, path, f"dashboard-{swept.name}-trialTable", tmp_path, size="1400,1800")  # the table is low


# Four told trials of a pareto study (val_bpb down, core up): the third is dominated by the second.
PARETO_VALUES = [(1.0, 0.10), (1.1, 0.20), (1.2, 0.15), (0.9, 0.05)]


@pytest.fixture(scope="module")
def pareto(tmp_path_factory):
    """A pareto study opened by the sweep's driver (directions and objective names as a sweep sets them)."""
    import io

    from sweep.run.driver import Driver
    from sweep.spec import load

    d = tmp_path_factory.mktemp("pareto")
    url = st.resolve_url(f"journal:{d / 'j.log'}")
    sections = tiny_spec(objective={"type": "pareto", "metrics": ["val_bpb", "core"]},
                         fixed={**tiny_spec()["fixed"], "core_bundle": "demo"}, study={"n_trials": 4})
    driver = Driver(load(write_spec(d, "front", sections)), out=io.StringIO())
    driver.url = url
    study = driver.open_study()
    for values in PARETO_VALUES:
        trial = study.ask()
        driver.spec.space.suggest(trial)
        study.tell(trial, list(values))
    with dashboard.running(url, str(d / "art")) as base:
        yield SimpleNamespace(base=base, sid=_study_id(base, "front"), dir=d)


def test_api_shows_a_pareto_studys_objectives_and_front(pareto):
    detail = _json(f"{pareto.base}/api/studies/{pareto.sid}")
    assert detail["objective_names"] == ["val_bpb", "core"]
    assert [t["number"] for t in detail["best_trials"]] == [0, 1, 3]  # the trial dominated by trial 1 is out


@NO_CHROMIUM
def test_headless_chromium_renders_a_pareto_studys_front(pareto):
    page = _chromium("--dump-dom", f"{pareto.base}/dashboard/studies/{pareto.sid}", tmp_path=pareto.dir)
    assert page.returncode == 0, page.stderr[-2000:]
    text = _text(page.stdout)
    assert "Pareto Front" in text and "Objective X: val_bpb" in text and "Objective Y: core" in text
    best = text[text.index("Best Trials"):]
    for n, (bpb, core) in enumerate(PARETO_VALUES):
        shown = f"Trial {n} Objective Values = [{bpb:g}, {core:g}]"
        assert (shown in best) == (n != 2), shown


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not pg_available(), reason="PostgreSQL is not running")
def test_dashboard_command_never_shows_the_storage_password(tmp_path):
    secret = "pw-" + os.urandom(6).hex()
    spec = write_spec(tmp_path, "secret", tiny_spec(trial=TRIAL))
    with pg_database(password=secret) as url:  # the server trusts local connections: any password works
        study = optuna.create_study(study_name="secret", storage=st.open_storage(url))
        study.add_trial(optuna.trial.create_trial(value=1.5, intermediate_values={1: 2.0, 3: 1.5}))
        port = _free_port()
        env = sweep_env(url, tmp_path / "art")
        proc = subprocess.Popen(sweep_cmd("dashboard", str(spec), "--port", str(port)), env=env, cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            first = proc.stdout.readline()
            assert first.startswith(f"optuna-dashboard: http://127.0.0.1:{port}/dashboard/studies/"), first
            # Read the storage line here too: lines already in this reader's buffer never reach communicate().
            storage_line = proc.stdout.readline()
            base = f"http://127.0.0.1:{port}"
            sid = int(first.strip().rsplit("/", 1)[1])
            assert [t["number"] for t in _json(f"{base}/api/studies/{sid}")["trials"]] == [0]
            assert _get(f"{base}/api/studies/{sid + 1000}")[0] == 404
            assert _get(f"{base}/api/studies/{sid}/plot/nosuchplot")[0] == 404
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 0, err
    assert secret not in first + storage_line + out + err
    assert "postgres:***@" in storage_line
    assert f"GET /api/studies/{sid}" in err  # the access log went through the scrubbed stream


def test_opening_a_study_writes_its_summary_if_it_has_none(tmp_path):
    from optuna_dashboard import get_note

    url = st.resolve_url(f"journal:{tmp_path / 'j.log'}")
    study = optuna.create_study(study_name="old", storage=st.open_storage(url))
    assert dashboard.study_path(url, "old") is not None and get_note(study) == ""  # nothing complete: no summary
    study.add_trial(optuna.trial.create_trial(value=1.5, intermediate_values={1: 2.0, 3: 1.5},
                                              user_attrs={"val_bpb": 1.5, "steps": 7}))
    assert dashboard.study_path(url, "old") == f"/dashboard/studies/{study._study_id}"
    note = get_note(study)
    assert note.startswith("## Best trials\n") and "| [0](" in note and "| 1.5000 | – | 7 |" in note
    assert study.metric_names == ["val_bpb"]


def test_a_busy_port_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(st.ENV_STORAGE, f"journal:{tmp_path / 'j.log'}")
    monkeypatch.setenv(art.ENV_ARTIFACTS, str(tmp_path / "art"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert cli.main(["dashboard", "--port", str(s.getsockname()[1])]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot listen" in err and "--port" in err


def test_scrubbed_stream_drops_every_form_of_the_password():
    import io

    url = "postgresql+psycopg2://u:p%40ss%2Fw@db/x"
    sink = io.StringIO()
    stream = dashboard._Scrubbed(sink, url)
    stream.write("connect p@ss/w failed; url p%40ss%2Fw\n")
    assert "p@ss/w" not in sink.getvalue() and "p%40ss%2Fw" not in sink.getvalue()


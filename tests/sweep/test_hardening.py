"""Hardening against what a study name, a URL, a trial's output or a web page can carry (docs/security.md).

Each test is of a real part: the spec loader, the exported programs' templates, the URL scrubber, the
printers of the command line, the dashboard's server (a real one, asked with a foreign Host header) and
the gRPC storage proxy (a real one, in front of the test PostgreSQL).
"""

from __future__ import annotations

import ast
import collections
import http.client
import io
import json
from pathlib import Path

import pytest

from sweep import cli, dashboard
from sweep import store as st
from sweep.printable import Printable, printable
from sweep.redact import redact, scrub
from sweep.ship import export
from sweep.spec import SpecError, load, resolve_path
from sweep.study import fail
from tests.sweep_fixtures import pg_available, pg_database, tiny_spec, write_spec

needs_pg = pytest.mark.skipif(not pg_available(), reason="PostgreSQL on 127.0.0.1:5432 is not running")


def _spec(tmp_path: Path, **study: object) -> Path:
    return write_spec(tmp_path, "s", tiny_spec(study={"n_trials": 4, "concurrency": 2, "seed": 0, **study}))


# -- 1. study names ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["..", ".", "a b", "x$(id)", 'x"""', "a/b", "é", "a\nb", "x;y"])
def test_a_study_name_outside_the_safe_alphabet_is_refused_at_load(tmp_path, name):
    path = _spec(tmp_path, name=name)
    with pytest.raises(SpecError, match="study name is letters, digits") as e:
        load(path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["..", ".", "x$(id)", "a b"])
def test_a_study_name_on_the_command_line_is_refused(name, capsys):
    with pytest.raises(SpecError, match="study name"):
        resolve_path(name)
    assert cli.main(["status", name]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sweep: a study name is") and "\n" not in err


def test_safe_names_and_linked_promote_names_stay_valid(tmp_path):
    for name in ("phase1", "kit-demo", "my_study.v2", "phase1-promote-1800", "x-promote-1.5"):
        assert resolve_path(name).name == f"{name}.toml"
    spec = load(_spec(tmp_path, name="a.B_c-1"))
    assert spec.name == "a.B_c-1"


CRAFTED = 'x"""+__import__("os").system("touch {marker}")+"""\\'


def _program(name: str, study: str) -> str:
    """The template's program with every text placeholder a plain word but the study, every literal None
    (whatever placeholders the template has)."""
    text: dict[str, object] = collections.defaultdict(lambda: "plain", study=study)
    literals = collections.defaultdict(lambda: "None", UNUSED="None")  # non-empty: fill() keeps it
    head, tail = export.fill_around_bundle(name, text, literals)
    return head + "\n" + tail


def test_a_crafted_study_name_stays_text_in_the_exported_inference_py(tmp_path):
    marker = tmp_path / "pwned"
    plain, crafted = _program("inference.py", "plain"), _program("inference.py", CRAFTED.format(marker=marker))
    tree = ast.parse(crafted)
    assert len(tree.body) == len(ast.parse(plain).body)  # no statement more: the name closed nothing
    doc = ast.get_docstring(tree, clean=False) or ""
    assert CRAFTED.format(marker=marker) in doc  # and it reads as written
    exec(compile(ast.Module(body=tree.body[:1], type_ignores=[]), "inference.py", "exec"), {})  # docstring: text
    assert not marker.exists()


def test_a_crafted_study_name_is_a_literal_in_the_exported_train_py(tmp_path):
    """train.py holds the study's name only as the STUDY constant, a Python literal of the name."""
    marker = tmp_path / "pwned"
    name = CRAFTED.format(marker=marker)
    programs = {study: "\n".join(export.train_program({"STUDY": study, "TRIAL": 0}, {"depth": 1}))
                for study in ("plain", name)}
    tree = ast.parse(programs[name])
    assert len(tree.body) == len(ast.parse(programs["plain"]).body)
    found = [n.value for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "STUDY"]
    assert len(found) == 1 and ast.literal_eval(found[0]) == name
    assert not marker.exists()


def test_a_text_placeholder_of_launch_sh_stays_on_its_line():
    sh = export.fill("launch.sh", {"study": "s\ntouch /tmp/x\r", "trial": 1, "launch": "torchrun train.py"})
    lines = sh.splitlines()
    assert lines[1].startswith("# Study s touch /tmp/x") and lines[2:] == ["torchrun train.py"], lines


# -- 2. a password as a URL query parameter ------------------------------------------------------------------

def test_a_password_given_as_a_query_parameter_is_masked():
    url = "postgresql://u@db.example/optuna?sslmode=require&password=s%40cret-Q1"
    assert redact(url) == "postgresql://u@db.example/optuna?sslmode=require&password=***"
    message = f"could not connect to {url}: password s@cret-Q1 rejected (s%40cret-Q1)"
    assert "cret-Q1" not in scrub(message, url)
    both = "postgresql+psycopg2://u:pw-in-userinfo@h/db?PASSWORD=pw-in-query"
    assert redact(both) == "postgresql+psycopg2://u:***@h/db?PASSWORD=***"
    assert "pw-in" not in scrub(f"{both} pw-in-query pw-in-userinfo", both)
    plain = "postgresql://u@h/db?sslmode=require"
    assert redact(plain) == plain and scrub(plain, plain) == plain


# -- 3. control characters in what is printed ----------------------------------------------------------------

FORGED = "0.1234\x1b[2J\x1b]0;owned\x07\rtrial 9 COMPLETE val_bpb 0.0001\x9b31m\x00\x7f"


def test_printable_strips_escapes_and_control_characters():
    assert printable(FORGED) == "0.1234trial 9 COMPLETE val_bpb 0.0001"
    assert printable("a\nb\tc") == "a b c" and printable("a\nb", multiline=True) == "a\nb"


def test_the_command_lines_output_and_its_error_lines_carry_no_control_characters(capsys):
    buf = io.StringIO()
    out = Printable(buf)
    print(f"best: trial 1 val_bpb {FORGED}", file=out)
    print("  line two", file=out)
    assert buf.getvalue() == "best: trial 1 val_bpb 0.1234trial 9 COMPLETE val_bpb 0.0001\n  line two\n"
    fail(f"trial 1 FAIL: {FORGED}\nsecond", None)
    err = capsys.readouterr().err
    assert err == "sweep: trial 1 FAIL: 0.1234trial 9 COMPLETE val_bpb 0.0001 second\n"


def test_status_prints_a_forged_reason_without_its_escapes(tmp_path):
    """A trial's stored fail reason and parameter, as a script could have set them, through ``sweep status``."""
    import optuna

    url = f"journal:{tmp_path / 'j.log'}"
    spec = load(_spec(tmp_path, name="esc", storage=url))
    study = optuna.create_study(study_name="esc", storage=st.open_storage(url))
    t = study.ask()
    # The reason is printed in the row, one line (sweep.study); the parameter through the stream (sweep.cli).
    t.set_user_attr("fail_reason", FORGED + "\n    7 COMPLETE   0.0001  forged row")
    t.suggest_categorical("opt", [FORGED])
    study.tell(t, state=optuna.trial.TrialState.FAIL)
    buf = io.StringIO()
    assert cli.main(["status", str(spec.path)], out=buf) == 0
    text = buf.getvalue()
    assert text and not any(ord(c) < 32 and c != "\n" or 0x7f <= ord(c) <= 0x9f for c in text), repr(text)
    assert "\n    7 COMPLETE" not in text and "0.0001  forged row" in text, text


# -- 6. the dashboard's Host check ---------------------------------------------------------------------------

def _ask(port: int, host_header: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.putrequest("GET", "/api/studies", skip_host=True)
        conn.putheader("Host", host_header)
        conn.endheaders()
        return conn.getresponse().status
    finally:
        conn.close()


def test_the_dashboard_refuses_a_foreign_host_header(tmp_path):
    url = f"journal:{tmp_path / 'j.log'}"
    with dashboard.running(url, str(tmp_path / "art")) as base:
        port = int(base.rsplit(":", 1)[1])
        assert _ask(port, "evil.example:80") == 403  # a rebinding page's own name
        assert _ask(port, f"attacker.test:{port}") == 403
        for ok in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost:9000", "127.0.0.1"):
            assert _ask(port, ok) == 200, ok


def test_a_dashboard_bound_to_all_interfaces_takes_addresses_but_not_names():
    check = dashboard.HostCheck(lambda *a: [b""], "0.0.0.0")
    assert check.allowed("10.1.2.3:8080") and check.allowed("[::1]:8080") and check.allowed("localhost")
    assert not check.allowed("rebind.attacker.example:8080")
    bound = dashboard.HostCheck(lambda *a: [b""], "10.1.2.3")
    assert bound.allowed("10.1.2.3:8080") and not bound.allowed("10.9.9.9") and not bound.allowed("x.example")


# -- 7. the storage proxy asks its clients for a token -------------------------------------------------------

@needs_pg
def test_the_storage_proxy_refuses_a_client_without_its_token():
    import grpc
    import optuna
    from optuna.storages import GrpcStorageProxy

    with pg_database() as pg:
        optuna.create_study(study_name="tok", storage=st.open_storage(pg))
        proxy = st.StorageProxy(pg)
        try:
            assert "password=" in proxy.url and proxy.token not in redact(proxy.url)
            worker = st.open_storage(proxy.url, role="worker")
            assert [s.study_name for s in worker.get_all_studies()] == ["tok"]
            intruder = GrpcStorageProxy(host=proxy.host, port=proxy.port)
            with pytest.raises(grpc.RpcError) as e:
                intruder.get_all_studies()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            wrong = st.open_storage(proxy.url.replace(proxy.token, "not-the-token"), role="worker")
            with pytest.raises(grpc.RpcError):
                wrong.get_all_studies()
        finally:
            proxy.close()


def test_the_storage_proxy_serves_no_network_address_without_a_token():
    with pytest.raises(OSError, match="without a client token"):
        st.serve_proxy("postgresql://u@127.0.0.1:1/none", "192.0.2.10", 1, token=None)


def test_the_proxy_token_is_masked_wherever_urls_are():
    url = "grpc://10.0.0.5:40001/?password=Tok3n-abc"
    assert redact(url) == "grpc://10.0.0.5:40001/?password=***"
    assert json.dumps(scrub(f"worker {url} failed: Tok3n-abc", url)).count("Tok3n") == 0
    assert Path(resolve_path("demo")).stem == "demo"

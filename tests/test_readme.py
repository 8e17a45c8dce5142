"""The README as a stranger reads it: what it is for, the two commands, what you get and where, first; every
link inside the repository; every `make` target it names defined; the summary it shows is the one printed."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _sections() -> list[str]:
    return re.findall(r"^## (.+)$", README, flags=re.M)


def test_it_opens_with_what_it_is_for_then_the_two_commands_and_what_you_get():
    intro = README.split("\n## ", 1)[0]
    assert "val_bpb" in intro and "competition" in intro and "Trainium" in intro
    assert _sections()[0].startswith("Quick start")
    quick = README.split("\n## ", 2)[1]
    assert "make sweep STUDY=demo" in quick and "make test" in quick
    for what in ("`.venv/`", "2 GB", "minutes", "runs/optuna-journal.log", "runs/artifacts/demo/N/", "final.pt",
                 "checkpoint: runs/artifacts/demo/", "make dashboard STUDY=demo", "-m sweep promote demo",
                 "-m sweep export demo --out submission/", "make clean", "make clean-studies"):
        assert what in quick, what


def test_a_spec_is_not_called_a_study():
    assert "A study is a spec" not in README
    assert "A study spec is a TOML file" in README and "the stored study" in README


def test_every_link_points_inside_the_repository():
    links = LINK.findall(README)
    assert links
    for target in links:
        assert "://" not in target and not target.startswith(("mailto:", "/")), target
        path = target.split("#", 1)[0]
        assert (ROOT / path).exists(), target


def test_every_make_target_it_names_exists():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", makefile, flags=re.M))
    named = set(re.findall(r"\bmake ([a-z][\w-]*)", README))
    assert named and named <= targets, named - targets

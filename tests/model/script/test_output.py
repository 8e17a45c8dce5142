"""The script's output read defensively (model.script.output): progress lines, FAIL, the summary block, fuzzed."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from model.script.output import MAX_LINE, Patterns, Reader

RUN = (b"step 00001 (0.0%) | loss: 9.000000 | remaining: 20s    \r"
       b"step 00002 (12.5%) | loss: 8.500000 | dt: 10ms | tok/sec: 12,345 | remaining: 17s    \r"
       b"step 00003 (50.0%) | loss: 7.25 | remaining: 10s\r\n"
       b"---\nval_bpb:          1.234567\ntraining_seconds: 20.1\nover_budget:      False\nnum_steps:        3\n"
       b"note: a sentence, kept as text\n")


def _all(reader: Reader, chunks: list[bytes]) -> list[tuple[str, object]]:
    out = [x for c in chunks for x in reader.feed(c)]
    return out + reader.finish()


def test_autoresearch_progress_lines_and_the_summary_block():
    r = Reader()
    lines = _all(r, [RUN])
    figures = [f for _, f in lines if f is not None]
    assert [(f.step, f.progress, f.loss) for f in figures] == [(1, 0.0, 9.0), (2, 0.125, 8.5), (3, 0.5, 7.25)]
    assert r.summary == {"val_bpb": 1.234567, "training_seconds": 20.1, "over_budget": False, "num_steps": 3,
                         "note": "a sentence, kept as text"}
    assert r.failed_line is None


def test_fail_and_non_finite_losses_and_configured_patterns():
    r = Reader(Patterns.build({"val": r"val_loss=([0-9.]+)", "progress": r"([0-9.]+)% done"}))
    lines = _all(r, [b"40% done loss: nan val_loss=3.5\nFAIL\n"])
    f = lines[0][1]
    assert f.progress == 0.4 and math.isnan(f.loss) and f.val == 3.5
    assert r.failed_line == "FAIL"
    with pytest.raises(ValueError, match="output.loss: needs a group"):
        Patterns.build({"loss": "loss"})
    with pytest.raises(ValueError, match="output.nope: unknown pattern"):
        Patterns.build({"nope": "(x)"})


def test_fail_written_onto_autoresearchs_open_progress_line_is_seen_and_words_containing_fail_are_not():
    # autoresearch redraws its progress line with \r, leaves it open (end=""), then prints FAIL on a NaN.
    for tail in (b"remaining: 280s    FAIL\n", b"remaining: 280sFAIL\n", b"remaining: 280s\rFAIL\n"):
        r = Reader()
        _all(r, [b"step 00011 (3.7%) | loss: 4.100000 | remaining: 281s    \rstep 00012 (4.0%) | loss: 4.0 | " + tail])
        assert r.failed_line is not None and r.failed_line.endswith("FAIL"), tail
    for ordinary in (b"FAILURE_RATE: 0.1\n", b"retries: MAX_FAIL\n", b"these may fail\n", b"FAILED_STEPS 3\n",
                     b"step 00012 (4.0%) | loss: 4.0 | FAIL_COUNT 0\n"):
        r = Reader()
        _all(r, [ordinary])
        assert r.failed_line is None, ordinary


def test_a_script_that_prints_fail_after_its_open_progress_line_ends_diverged(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("for step in range(1, 4):\n"
                      "    print(f'\\rstep {step:05d} ({10 * step:.1f}%) | loss: {4 / step:.6f} | remaining: 9s    ',"
                      " end='', flush=True)\n"
                      "print('FAIL')\n"
                      "raise SystemExit(1)\n")
    proc = subprocess.run([sys.executable, "-m", "model.script.run", "--config", json.dumps({"script": str(script)}),
                           "--budget-s", "5", "--json", "--out-dir", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=60)
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["status"] == "diverged" and result["reason"].endswith("remaining: 9s    FAIL'"), result


@settings(max_examples=200, deadline=None)
@given(hs.binary(max_size=3000), hs.lists(hs.integers(0, 3000), max_size=8))
def test_any_bytes_in_any_chunks_read_the_same_and_never_raise(blob, cuts):
    cuts = sorted({min(c, len(blob)) for c in cuts})
    chunks = [blob[a:b] for a, b in zip([0, *cuts], [*cuts, len(blob)], strict=True)]
    whole, split = Reader(max_line=512), Reader(max_line=512)
    assert [ln for ln, _ in _all(whole, [blob])] == [ln for ln, _ in _all(split, chunks)]
    assert whole.summary == split.summary and len(whole.summary) <= 200


# Fields of an autoresearch progress line: (text, the figure it must read as, whether it makes the line a progress
# line). Well formed, or malformed: a number that does not parse is absent; one that parses but is out of range
# (40 digits of step, 400 of percent) reads as None on a line that is still a progress line.
STEP_FIELDS = hs.one_of(hs.integers(0, 99999).map(lambda n: (f"step {n:05d}", n, True)),
                        hs.sampled_from([("", None, False), ("step", None, False), ("step -3", None, False),
                                         ("xstep 00004", None, False), ("step " + "9" * 40, None, True)]))
PERCENT_FIELDS = hs.one_of(hs.integers(0, 1000).map(lambda t: (f"({t / 10:.1f}%)", min(t / 1000, 1.0), True)),
                           hs.sampled_from([("", None, False), ("(%)", None, False), ("(-5%)", None, False),
                                            ("(1e999%)", None, False), ("( 150 % )", 1.0, True),
                                            ("(" + "9" * 400 + "%)", None, True)]))
LOSS_FIELDS = hs.one_of(hs.integers(0, 20_000_000).map(lambda m: (f"loss: {m / 1e6:.6f}", m / 1e6, True)),
                        hs.sampled_from([("", None, False), ("loss:", None, False), ("loss: .", None, False),
                                         ("loss: 1.2.3", None, False), ("loss: -", None, False),
                                         ("loss: inf", math.inf, True), ("loss: 1e999", math.inf, True),
                                         ("loss: nan", math.nan, True)]))
NOISE = hs.sampled_from(["", "| dt: 10ms", "| tok/sec: 12,345", "| remaining: 20s", "\x00", "é", "|", "lrm: 1.00"])


def _same(got: float | None, want: float | None) -> bool:
    return (got is None and want is None) or (got is not None and want is not None and (
        (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, rel=1e-12)))


@settings(max_examples=100, deadline=None)
@given(hs.lists(hs.tuples(STEP_FIELDS, PERCENT_FIELDS, LOSS_FIELDS, NOISE), min_size=1, max_size=8),
       hs.sampled_from(["\r", "\n", "\r\n"]))
def test_malformed_progress_fields_read_as_absent_and_the_rest_exactly(fields, end):
    text = end.join(f"{st[0]} {pc[0]} {noise} | {loss[0]} {noise}" for st, pc, loss, noise in fields)
    got = [f for _, f in _all(Reader(), [text.encode("utf-8", "surrogatepass")])]
    assert len(got) == len(fields)  # every line has its bar, so none is empty
    for f, (st, pc, loss, _) in zip(got, fields, strict=True):
        if not (st[2] or pc[2] or loss[2]):
            assert f is None  # no figure: not a progress line
            continue
        assert f is not None and f.step == st[1] and f.val is None
        assert _same(f.progress, pc[1]) and _same(f.loss, loss[1])


def test_a_ten_megabyte_line_is_cut_and_the_next_line_still_reads():
    r = Reader()
    lines = _all(r, [b"x" * (10 << 20), b"y" * 100, b"\nstep 00007 (70.0%) | loss: 3.0\n"])
    assert len(lines[0][0]) == MAX_LINE
    assert lines[1][1].step == 7 and lines[1][1].progress == 0.7

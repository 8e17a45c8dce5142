"""``python -m sweep export NAME [--trial N] --out DIR``: a trial as the competition takes it.

Writes three files into DIR:

- ``train.py``: one self-contained file under the upload limit. It carries the ``model`` and
  ``kernels`` packages as they are on disk (:mod:`sweep.bundle`), so it runs the project's own
  trainer, the code the sweep trained, with the trial's resolved config (its result record's
  ``config``) baked in. The keys that describe the sweep's machine rather than the configuration are
  set to what a submission needs (:data:`SUBMISSION`, listed again at the top of the file). Launched
  with no arguments it trains for the competition's budget, writes ``out/final.pt`` and prints the
  summary block; ``load_for_eval(checkpoint_path, device)`` is defined at its top level.
  ``TRAIN_OVERRIDES`` (a JSON object merged over the config) runs it elsewhere, e.g. on the CPU for
  a few seconds on the demo corpus.
- ``launch.sh``: ``NEURON_LOGICAL_NC_CONFIG={1|2} torchrun --standalone --nproc_per_node={1|4|8} train.py``
  from the trial's launch shape (what the worker recorded, else the spec's).
- ``provenance.json``: study, trial, params, val_bpb (the record's), the objective's values, the code
  version exported and the one the trial ran, the bundle's module digests, the sha256 of ``train.py``
  and the export time.

The default trial is the study's best complete one (a composite study's: its highest score); a pareto
study has no single best, so ``--trial N`` picks one of its front (the error lists them). Exit codes: 2
for bad input (unknown study or trial, a trial without a result record, a launch shape the competition
cannot run, a pareto study without ``--trial``), 1 when the file would exceed the upload limit or
anything else fails.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import pprint
from pathlib import Path
from typing import Any, TextIO

from sweep import bundle, neuron
from sweep import objective as obj
from sweep.artifacts import code_version
from sweep.study import best_trial, fail, load_study, parse_seconds

COMPETITION_BUDGET_S = 1800.0  # TRAIN_TIME_BUDGET_SECONDS of the kit
COMPETITION_VOCAB = 8192  # TOKENIZER_VOCAB_SIZE of the kit
COMPETITION_RANKS = (1, 4, 8)
OVERRIDES_ENV = "TRAIN_OVERRIDES"
KIT_ENV = "TRNSWEEP_KIT_PREPARE"  # model.kit.ENV_VAR (sweep does not import model)

# Trainer keys that belong to the machine, not the configuration: what a submission runs with, and why.
SUBMISSION: dict[str, tuple[Any, str]] = {
    "device": ("neuron", "the competition's Trainium2 chip"),
    "data": ("kit", "the kit's prepare.py: its data, tokenizer and loaders (found when train.py starts)"),
    "tokenizer": ("", "the kit's tokenizer"),
    "val_shard": ("", "the kit's validation split"),
    "cache_dir": ("runs/cache", "the trainer's default, not the sweep machine's path"),
    "num_threads": (0, "torch's default; a sweep pins CPU threads to share its machine"),
    "startup_allowance_s": (900.0, "TRAIN_STARTUP_ALLOWANCE_CAP_SECONDS of the kit"),
    "excluded_steps": (2, "the lower of the kit's reported TRAIN_STARTUP_STEPS_EXCLUDED (2 or 5): never under-charge"),
    "max_steps": (0, "the charged clock alone ends training"),
    "eval_fractions": ([], "no intermediate evaluations: an outside clock would charge them"),
    "eval_at_start": (False, "no evaluation before training"),
    "save_checkpoint": (True, "out/final.pt is what the evaluation reads"),
    "core_bundle": ("", "the competition scores CORE itself, after training, through inference.py"),
}


class ExportError(ValueError):
    """Bad input for export; exit 2 with this one line."""


def add_parser(sub: Any) -> None:

    p = sub.add_parser("export", help="write a trial as a competition submission: train.py, launch.sh, provenance")
    p.add_argument("study", help="NAME (sweep/studies/NAME.toml), a linked study (NAME-promote-B) or a .toml path")
    p.add_argument("--trial", type=int, default=None, metavar="N", help="trial number (default: the best complete; "
                   "required for a pareto study: one of its front)")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="directory to write the files into")
    p.add_argument("--budget-s", type=parse_seconds, default=COMPETITION_BUDGET_S, metavar="N",
                   help=f"charged training seconds baked in (default {COMPETITION_BUDGET_S:g}, the competition's)")


def main(spec: Any, url: str, args: argparse.Namespace, out: TextIO) -> int:

    try:
        study = load_study(spec, url)
        trial = pick_trial(study, args.trial, spec.objective)
        result = export(spec, study.study_name, trial, args.out, args.budget_s)
    except ExportError as e:
        fail(str(e), url)
        return 2
    except bundle.BundleError as e:
        fail(str(e), url)
        return 1
    for w in result["warnings"]:
        fail(f"warning: {w}", url)
    p = result["provenance"]
    shown = {"val_bpb": p["val_bpb"], **p["values"]}
    values = ", ".join(f"{k} {v:.4f}" if isinstance(v, (int, float)) else f"{k} ?" for k, v in shown.items())
    print(f"exported trial {p['trial']} of study {p['study']} ({values}) to {args.out}: "
          f"train.py {p['train_py_bytes']:,} bytes ({p['bundle']['encoding']}), launch: {p['launch']}", file=out,
          flush=True)
    return 0


# -- choosing the trial ----------------------------------------------------------------------------

def record_config(t: Any) -> dict[str, Any] | None:
    """The resolved trainer config of a trial's result record, if it has one."""
    fields = t.user_attrs.get("record_fields") or []
    config = t.user_attrs.get("config") if "config" in fields else None
    return config if isinstance(config, dict) else None


def pick_trial(study: Any, number: int | None, objective: obj.Objective | None = None) -> Any:
    """Trial ``number``, or the best complete one (none for a multi-objective study: ``number`` is then
    required); it must have finished with a result record."""

    trials = study.get_trials(deepcopy=False)
    if number is None and len(study.directions) > 1:
        directions = [d.name.lower() for d in study.directions]
        members = [t.number for t in obj.front(trials, directions)]
        if not members:
            raise ExportError(f"study {study.study_name!r} has no complete trial to export")
        names = objective.describe() if objective is not None else ", ".join(study.metric_names or directions)
        raise ExportError(f"study {study.study_name!r} is multi-objective ({names}): no single best; choose a trial "
                          f"of its Pareto front with --trial N (front: trial{'s' * (len(members) > 1)} "
                          f"{', '.join(map(str, members))})")
    if number is None:
        best = best_trial(trials, study.direction.name.lower())
        if best is None:
            raise ExportError(f"study {study.study_name!r} has no complete trial to export")
        t = best
    else:
        found = [t for t in trials if t.number == number]
        if not found:
            raise ExportError(f"--trial {number}: study {study.study_name!r} has no trial {number}")
        t = found[0]
    if t.state.name != "COMPLETE" or record_config(t) is None:
        why = t.user_attrs.get("fail_reason")
        raise ExportError(f"trial {t.number} of study {study.study_name!r} has no result record to export "
                          f"(state {t.state.name}{'; ' + why if why else ''})")
    return t


# -- what the submission runs ----------------------------------------------------------------------

def submission_config(config: dict[str, Any], budget_s: float) -> dict[str, Any]:
    """The trial's resolved config with the machine's keys set for a submission (see SUBMISSION)."""
    out = dict(config)
    for k, (v, _) in SUBMISSION.items():
        out[k] = list(v) if isinstance(v, list) else v
    out["budget_s"] = float(budget_s)
    return out


def launch_shape(spec: Any, t: Any) -> tuple[int, int, str | None]:
    """(ranks, lnc, NEURON_CC_FLAGS) the trial ran with: as the worker recorded them, else as its spec says."""
    ranks, lnc = t.user_attrs.get("launch_ranks"), t.user_attrs.get("launch_lnc")
    flags = t.user_attrs.get("neuron_cc_flags")
    try:
        config = spec.space.trainer_config(t.params)
        s_ranks, s_lnc, s_flags = neuron.launch_values(config, spec.ranks, spec.env)
    except (neuron.LaunchError, ValueError) as e:
        if ranks is None:
            raise ExportError(f"trial {t.number}: its launch shape: {e}") from None
        s_ranks, s_lnc, s_flags = ranks, lnc, flags
    ranks = ranks if ranks is not None else s_ranks
    lnc = lnc if lnc is not None else (s_lnc or neuron.DEFAULT_NODE_LNC)
    flags = flags if flags is not None else s_flags
    if lnc not in neuron.LNC_VALUES:
        raise ExportError(f"trial {t.number} ran with NEURON_LOGICAL_NC_CONFIG={lnc}; the competition takes 1 or 2")
    if ranks not in COMPETITION_RANKS or ranks > 8 // lnc:
        raise ExportError(f"trial {t.number} ran with {ranks} rank(s) at LNC {lnc}; the competition launches "
                          f"1, 4 or 8 ranks, at most {8 // lnc} at LNC {lnc}")
    return ranks, lnc, flags


def launch_line(ranks: int, lnc: int) -> str:
    return f"NEURON_LOGICAL_NC_CONFIG={lnc} torchrun --standalone --nproc_per_node={ranks} train.py"


def _code_matches(exported: dict[str, Any], trained: dict[str, Any]) -> bool | None:
    """True: same clean commit; False: different commits; None: cannot tell (unknown or dirty)."""
    a, b = exported.get("git_commit", "unknown"), trained.get("git_commit", "unknown")
    if "unknown" in (a, b):
        return None
    if a != b:
        return False
    return None if exported.get("git_dirty") or trained.get("git_dirty") else True


def export(spec: Any, study_name: str, t: Any, out_dir: Path, budget_s: float = COMPETITION_BUDGET_S,
           root: Path = bundle.REPO_ROOT) -> dict[str, Any]:
    """Write train.py, launch.sh and provenance.json for trial ``t``; returns the provenance and warnings."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"--out {out_dir}: exists and is not a directory")
    ranks, lnc, flags = launch_shape(spec, t)
    trained_config = record_config(t) or {}
    config = submission_config(trained_config, budget_s)
    launch_env = {neuron.CC_FLAGS_VAR: flags} if flags else {}
    version = code_version(root)
    trained_version = {k: t.user_attrs[k] for k in ("git_commit", "git_dirty") if k in t.user_attrs}
    warnings = []
    matches = _code_matches(version, trained_version)
    if matches is False:
        warnings.append(f"trial {t.number} ran code at commit {trained_version['git_commit'][:12]}; this export "
                        f"bundles {version['git_commit'][:12]}")
    if config.get("vocab_size") != COMPETITION_VOCAB:
        warnings.append(f"the kit's tokenizer has {COMPETITION_VOCAB} tokens and this configuration "
                        f"{config.get('vocab_size')}: train.py refuses the kit's data (TRAIN_OVERRIDES can point "
                        "it at other data)")

    modules = bundle.collect(root)
    # A single study's value is val_bpb; a composite or pareto study's val_bpb is the record's.
    val_bpb = t.value if spec.objective.kind == "single" else t.user_attrs.get("val_bpb")
    values = dict(zip(spec.objective.names, t.values or (), strict=False))
    info = {"study": study_name, "trial": t.number, "val_bpb": val_bpb,
            "trained_budget_s": trained_config.get("budget_s"), "trained_device": t.user_attrs.get("device"),
            "version": version, "lnc": lnc, "launch": launch_line(ranks, lnc),
            "exported_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    text, encoding = bundle.render(_head(info, config, launch_env), _tail(config, lnc), modules)
    data = text.encode("utf-8")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "train.py").write_bytes(data)
    inference, _ = bundle.render(_inference_head(info), _INFERENCE_TAIL, modules)
    (out_dir / "inference.py").write_text(inference)
    sh = out_dir / "launch.sh"
    sh.write_text(f"#!/bin/sh\n# Study {study_name}, trial {t.number}: the competition's launch line, run from the "
                  f"directory holding train.py.\n{info['launch']}\n")
    sh.chmod(0o755)
    provenance = {
        "study": study_name, "trial": t.number, "params": dict(t.params), "val_bpb": val_bpb, "values": values,
        "objective": spec.objective.describe(),
        "trained_budget_s": info["trained_budget_s"], "trained_device": info["trained_device"],
        "budget_s": float(budget_s), "config": config,
        "submission_keys": {k: why for k, (_, why) in SUBMISSION.items()},
        "launch": info["launch"], "ranks": ranks, "lnc": lnc, "launch_env": launch_env,
        "code_version": version, "trial_code_version": trained_version, "code_matches_trial": matches,
        "spec_hash": t.user_attrs.get("spec_hash"),
        "bundle": {"id": bundle.bundle_id(modules), "encoding": encoding,
                   "modules": {m.name: m.sha256 for m in modules}},
        "train_py_sha256": hashlib.sha256(data).hexdigest(), "train_py_bytes": len(data),
        "inference_py_sha256": hashlib.sha256(inference.encode("utf-8")).hexdigest(),
        "upload_limit_bytes": bundle.UPLOAD_LIMIT_BYTES, "exported_at": info["exported_at"],
    }
    (out_dir / "provenance.json").write_text(json.dumps(provenance, indent=1, default=str) + "\n")
    return {"provenance": provenance, "warnings": warnings}


def _inference_head(info: dict[str, Any]) -> str:
    return f'''#!/usr/bin/env python3
"""Phase-2 inference.py exported by trnsweep beside train.py (study {info["study"]}, trial {info["trial"]}).

Scores CORE on the checkpoint train.py wrote, with the same model code and evaluation the sweep used
(trnsweep's model.inference, bundled below):
    python inference.py --checkpoint out/final.pt --bundle EVAL_BUNDLE_DIR [--max-seconds 3600] --json
Under torchrun the examples are shared across ranks. Code: trnsweep {info["version"].get("git_commit", "unknown")}.
"""

import os
import sys
'''


_INFERENCE_TAIL = '''# ---- the entry point ----------------------------------------------------------------------------

from model.inference import main  # noqa: E402
from model.train import load_for_eval  # noqa: E402,F401

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
'''


# -- the generated file ----------------------------------------------------------------------------

def _head(info: dict[str, Any], config: dict[str, Any], launch_env: dict[str, str]) -> str:
    set_keys = "\n".join(f"    {k} = {config[k]!r}: {why}" for k, (_, why) in SUBMISSION.items())
    v = info["version"]
    dirty = " (uncommitted changes)" if v.get("git_dirty") else ""
    val = f"{info['val_bpb']:.4f}" if isinstance(info["val_bpb"], float) else info["val_bpb"]
    return f'''#!/usr/bin/env python3
"""Competition train.py exported by trnsweep: study {info["study"]}, trial {info["trial"]} (val_bpb {val} \
in {info["trained_budget_s"]} s on {info["trained_device"]}).

Launch, with no arguments:
    {info["launch"]}
It trains the trial's configuration (CONFIG, at the end) with trnsweep's own trainer, bundled below with
the model and kernels packages exactly as the sweep ran them, for budget_s = {config["budget_s"]:g} charged
seconds; writes out/final.pt and prints the summary block after a `---` line. load_for_eval(checkpoint_path,
device) returns the trained model for evaluation. Generated: re-export rather than edit.

Set for a submission instead of copied from the sweep's machine (everything else is the trial's record):
    budget_s = {config["budget_s"]!r}: the competition's charged training time
{set_keys}
The kit's prepare.py is looked for in ${KIT_ENV}, beside this file, in the working directory, then on
sys.path. To run elsewhere, {OVERRIDES_ENV} takes a JSON object merged over CONFIG, e.g.
    {OVERRIDES_ENV}='{{"device": "cpu", "data": "demo", "budget_s": 10}}' python train.py

Code: trnsweep {v.get("git_commit", "unknown")}{dirty}; exported {info["exported_at"]}.
"""

import importlib.util
import json
import os
import sys

# The launch line carries only NEURON_LOGICAL_NC_CONFIG; the rest of the trial's launch environment is set
# here, before torch loads, unless the caller set it.
LAUNCH_ENV = {launch_env!r}
for _key, _value in LAUNCH_ENV.items():
    os.environ.setdefault(_key, _value)
'''


def _tail(config: dict[str, Any], lnc: int) -> str:
    body = pprint.pformat(config, width=110, sort_dicts=True)
    return f'''# ---- the submission ---------------------------------------------------------------------------

from model.train import load_for_eval  # noqa: E402,F401  (the evaluation's entry point)

CONFIG = {body}
TRAINED_LNC = {lnc}
OUT_DIR = "out"
KIT_ENV = {KIT_ENV!r}
OVERRIDES_ENV = {OVERRIDES_ENV!r}


def _fail(message):
    print(f"train.py: {{message}}", file=sys.stderr, flush=True)
    return 2


def find_kit():
    """The kit's prepare.py: ${KIT_ENV}, beside this file, in the working directory, or on sys.path."""
    if os.environ.get(KIT_ENV):
        return os.environ[KIT_ENV]
    here = os.path.dirname(os.path.abspath(globals().get("__file__") or "train.py"))
    for folder in (here, os.getcwd()):
        if os.path.isfile(os.path.join(folder, "prepare.py")):
            return os.path.join(folder, "prepare.py")
    found = importlib.util.find_spec("prepare")
    return found.origin if found is not None and found.origin and os.path.isfile(found.origin) else None


def resolved_config():
    """CONFIG, with ${OVERRIDES_ENV} merged over it and the kit located; None (after one line) when impossible."""
    config = dict(CONFIG)
    raw = os.environ.get(OVERRIDES_ENV, "").strip()
    if raw:
        try:
            extra = json.loads(raw)
        except ValueError as e:
            _fail(f"{{OVERRIDES_ENV}} is not JSON: {{e}}")
            return None
        if not isinstance(extra, dict):
            _fail(f"{{OVERRIDES_ENV}} must be a JSON object of config keys, got {{raw[:80]!r}}")
            return None
        config.update(extra)
    if config.get("data") == "kit":
        kit = find_kit()
        if kit is None:
            _fail("the competition kit's prepare.py was not found (set " + KIT_ENV + " or put it beside train.py); "
                  + OVERRIDES_ENV + "='{{\\"data\\": \\"demo\\"}}' trains on the demo corpus instead")
            return None
        config["data"] = "kit:" + kit
    return config


def main():
    config = resolved_config()
    if config is None:
        return 2
    lnc = os.environ.get("NEURON_LOGICAL_NC_CONFIG")
    if config.get("device") == "neuron" and lnc != str(TRAINED_LNC):
        print(f"train.py: warning: NEURON_LOGICAL_NC_CONFIG={{lnc}}, the sweep trained this at {{TRAINED_LNC}}",
              file=sys.stderr, flush=True)
    from model import train as trainer

    return trainer.main(["--config", json.dumps(config), "--out-dir", OUT_DIR])


if __name__ == "__main__":
    exit_code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)  # as model.train does: everything is written; skip unloading torch
'''

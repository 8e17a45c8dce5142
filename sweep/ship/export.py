"""``python -m sweep export NAME [--trial N] --out DIR``: a trial as the competition takes it.

Writes four files into DIR (a study of a team's script: its ``train.py`` with the trial's constants, which
differs from the script only in those literals, ``launch.sh`` and ``provenance.json``; :func:`export_script`):

- ``train.py``: a competition submission in the kit's dialect, one self-contained file under the upload
  limit (docs/competition.md lists the kit's rules it follows and how each is tested). Its hyperparameters
  are module constants at its top, the trial's resolved config (its result record's ``config``) less the
  keys that belong to the machine or the kit (:data:`SUBMISSION`): those come from the kit's prepare.py
  beside it and from the baseline's flags, each with its ``NEURON_COMPETITION_R1_*`` fallback. It carries
  the ``model`` and ``kernels`` packages as they are on disk (:mod:`sweep.ship.bundle`), so it runs the
  project's own trainer, the code the sweep trained, on the kit's data; ``load_for_eval(checkpoint_path,
  device)`` is defined at its top level. Everything but the constants block is the template's text, so two
  exports differ only in their constants.
- ``launch.sh``: the competition's launch line, all of the chip's ranks at the trial's logical-core
  config: ``NEURON_LOGICAL_NC_CONFIG=1 torchrun --standalone --nproc_per_node=8 train.py`` or LNC=2 with 4.
- ``inference.py``: scores CORE on the checkpoint with the bundled ``model.inference``.
- ``provenance.json``: study, trial, params, val_bpb (the record's), the objective's values, the code
  version exported and the one the trial ran, the bundle's module digests, the sha256 of ``train.py``
  and the export time.

The programs' text is in ``sweep/ship/templates/`` (``train.py``, ``inference.py``, ``launch.sh``), real
files that ruff and a reader see; :func:`fill` puts the trial's values into their placeholders.

The default trial is the study's best complete one (a composite study's: its highest score); a pareto
study has no single best, so ``--trial N`` picks one of its front (the error lists them). Exit codes: 2
for bad input (unknown study or trial, a trial without a result record, a configuration the bundled trainer
refuses, a launch shape the competition cannot run, a pareto study without ``--trial``), 1 when the file
would exceed the upload limit or anything else fails.

Long file: the three kinds of export (our trainer's bundle, a team's script, the cold rehearsal's launch)
share the trial's launch shape and provenance, which read best in one place.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import re
import shlex
from pathlib import Path
from typing import Any, TextIO

from model.config import ConfigError, RunConfig, parse_config, resolve_batch
from sweep import neuron
from sweep.ship import bundle, rehearse
from sweep.spec import objective as obj
from sweep.store.artifacts import code_version
from sweep.study import best_trial, fail, load_study, parse_seconds

COMPETITION_BUDGET_S = 1800.0  # TRAIN_TIME_BUDGET_SECONDS of the kit
CHIP_CORES = 8  # physical NeuronCores of a trn2 chip: a scored run uses all of them, 8 // LNC ranks
EVAL_PUBLIC = "python prepare.py eval-public --train-py train.py --checkpoint out/final.pt"


def eval_public_line(config: dict[str, Any]) -> str:
    """The kit's scorer on the checkpoint, at the rows the exported file's --eval-public scores by default and
    the trial's record scored: context EVAL_SEQ_LEN (0: SEQ_LEN), FINAL_EVAL_TOKENS tokens, batches of
    BATCH_SIZE rows (the kit names only --seq-len publicly; the other two are the flags of this project's
    kit-dialect stand-in: adjust them to the kit's own)."""
    seq_len = config.get("eval_seq_len") or config["seq_len"]
    return (f"{EVAL_PUBLIC} --seq-len {seq_len} --eval-tokens {config['final_eval_tokens']} "
            f"--batch-size {config['batch_size']}")

# Trainer keys that belong to the machine or the kit, not the configuration: what a submission runs with, and
# why. The exported train.py sets them at start-up; every other key of the trial's config is a constant in it.
SUBMISSION: dict[str, tuple[Any, str]] = {
    "device": ("neuron", "--device-type (default neuron, the competition's Trainium2 chip)"),
    "data": ("kit", "the kit's prepare.py beside train.py: its tokenizer, make_dataloader and scorer"),
    "vocab_size": (0, "the kit's tokenizer's (TOKENIZER_VOCAB_SIZE), whatever the study trained on"),
    "tokenizer": ("", "the kit's tokenizer"),
    "val_shard": ("", "the kit's public_val split, read only with --eval-public"),
    "cache_dir": (RunConfig.cache_dir, "the trainer's default, not the sweep machine's path"),
    "num_threads": (RunConfig.num_threads, "the trainer's (torch's) default; a sweep pins CPU threads"),
    "budget_s": (COMPETITION_BUDGET_S, "--max-train-seconds (default the kit's TRAIN_TIME_BUDGET_SECONDS) less "
                 "the checkpoint's reserve"),
    "startup_allowance_s": (900.0, "the kit's TRAIN_STARTUP_ALLOWANCE_CAP_SECONDS"),
    "excluded_steps": (5, "the kit's TRAIN_STARTUP_STEPS_EXCLUDED"),
    "eval_fractions": ([], "no intermediate evaluations: no validation data is read while training"),
    "eval_at_start": (False, "no evaluation before training"),
    "eval_tokens": (RunConfig.eval_tokens, "unused: no intermediate evaluations"),
    "final_eval_rows": (0, "the kit's evaluate_bpb scores every row"),
    "save_checkpoint": (True, "out/final.pt is what the evaluation reads"),
    "core_bundle": ("", "the competition scores CORE itself, after training, through inference.py"),
    "max_loss": (100.0, "the kit's bad-loss bound: a NaN loss or one over 100 stops every rank"),
    "log_every": (1, "the loss read every step, for the progress line's EMA and the bad-loss check"),
}
# Trial values kept as constants that a flag may override: its default.
FLAG_DEFAULTS = {"seed": "--seed", "compile": "--compile", "eval_seq_len": "--eval-seq-len (0: SEQ_LEN)",
                 "max_steps": "--num-steps (0: the charged clock alone)", "final_eval_tokens": "--eval-tokens",
                 "batch_size": "--eval-batch-size"}


class ExportError(ValueError):
    """Bad input for export; exit 2 with this one line."""


def add_parser(sub: Any) -> None:

    p = sub.add_parser("export", help="write a trial as a competition submission: train.py, launch.sh, provenance")
    p.add_argument("study", help="NAME (sweep/studies/NAME.toml), a linked study (NAME-promote-B) or a .toml path")
    p.add_argument("--trial", type=int, default=None, metavar="N", help="trial number (default: the best complete; "
                   "required for a pareto study: one of its front)")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="directory to write the files into")
    p.add_argument("--budget-s", type=parse_seconds, default=COMPETITION_BUDGET_S, metavar="N",
                   help=f"train.py's --max-train-seconds default (default {COMPETITION_BUDGET_S:g}: the kit's "
                   "TRAIN_TIME_BUDGET_SECONDS)")
    p.add_argument("--cold-rehearsal", action="store_true", help="first run the candidate once on an empty compile "
                   "cache, here (a competition node for the scorer's figure), and report its cold start-up")
    p.add_argument("--margin-s", type=parse_seconds, default=rehearse.DEFAULT_MARGIN_S, metavar="S",
                   help=f"cold start-up over this is said and marked (default {rehearse.DEFAULT_MARGIN_S:g}; the "
                        f"kit's cap is {rehearse.STARTUP_CAP_S:g})")


def main(spec: Any, url: str, args: argparse.Namespace, out: TextIO) -> int:

    try:
        study = load_study(spec, url)
        trial = pick_trial(study, args.trial, spec.objective)
        if getattr(args, "cold_rehearsal", False):
            cold_rehearsal(spec, study, trial, args.out, args.margin_s, out)
        result = export(spec, study.study_name, trial, args.out, args.budget_s)
    except rehearse.RehearsalError as e:
        fail(str(e), url)
        return 1
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
          f"train.py {p['train_py_bytes']:,} bytes of the upload limit's {bundle.UPLOAD_LIMIT_BYTES:,} "
          f"({p.get('bundle', {}).get('encoding', 'the team script')})", file=out, flush=True)
    print(f"launch: {p['launch']}", file=out, flush=True)
    if "eval_public" in p:
        print(f"check:  {p['eval_public']}", file=out, flush=True)
    return 0


def cold_rehearsal(spec: Any, study: Any, t: Any, out_dir: Path, margin_s: float, out: TextIO) -> dict[str, Any]:
    """The candidate's trainer config with the launch it trained with, once on an empty compile cache; one line,
    and the rehearsal recorded in the study (sweep/ship/rehearse.py)."""
    if spec.script is not None:
        raise ExportError("--cold-rehearsal runs our trainer's configurations; a script study's is its own")
    ranks, lnc, flags = launch_shape(spec, t)
    config = {**(record_config(t) or {}), "ranks": ranks, **({"lnc": lnc} if lnc else {}),
              **({"neuron_cc_flags": flags} if flags else {})}
    if t.user_attrs.get("neuron_opt_level"):
        config["neuron_opt_level"] = t.user_attrs["neuron_opt_level"]
    work = out_dir.parent / f".{out_dir.name}-cold-rehearsal"
    work.mkdir(parents=True, exist_ok=True)
    result = rehearse.rehearse(spec, config, work, margin_s, t.number)
    rehearse.mark(study, t.number, result)
    print(rehearse.verdict_line(t.number, result), file=out, flush=True)
    return result


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

# Keys older records carry that the trainer no longer takes: the test-only fault hook left its config
# for the TRNSWEEP_FAULT variable (model/faults.py).
RETIRED_KEYS = ("fault", "fault_step")


def submission_config(config: dict[str, Any], budget_s: float) -> dict[str, Any]:
    """The trial's resolved config with the machine's keys set for a submission (see SUBMISSION)."""
    out = {k: v for k, v in config.items() if k not in RETIRED_KEYS}
    for k, (v, _) in SUBMISSION.items():
        out[k] = list(v) if isinstance(v, list) else v
    out["budget_s"] = float(budget_s)
    return out


def launch_shape(spec: Any, t: Any) -> tuple[int, int, str | None]:
    """(ranks, lnc, NEURON_CC_FLAGS) the trial ran with: as the worker recorded them, else as its spec says
    (:func:`export` launches all of the chip's ranks at that LNC)."""
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
    return ranks, lnc, flags


def competition_shape(spec: Any, t: Any) -> tuple[int, int, str | None]:
    """(ranks, lnc, NEURON_CC_FLAGS) of a scored run of a kit script: the whole chip at the LNC the trial
    set (the cluster's default otherwise), whatever the trial itself ran on (a CPU trial's one or two ranks)."""
    lnc = t.user_attrs.get("launch_lnc")
    flags = t.user_attrs.get("neuron_cc_flags")
    with contextlib.suppress(neuron.LaunchError, ValueError):
        _, s_lnc, s_flags = neuron.launch_values(spec.space.trainer_config(t.params), spec.ranks, spec.env)
        lnc = lnc if lnc is not None else s_lnc
        flags = flags if flags is not None else s_flags
    lnc = lnc if lnc in neuron.LNC_VALUES else neuron.DEFAULT_NODE_LNC
    return neuron.CORES_PER_CHIP // lnc, lnc, flags


def launch_env_of(flags: str | None, t: Any) -> dict[str, str]:
    """The compiler settings the trial trained with, for the submission's environment: its NEURON_CC_FLAGS and
    the native stack's opt level (neuron_opt_level), where it set them."""
    env = {neuron.CC_FLAGS_VAR: flags} if flags else {}
    if t.user_attrs.get("neuron_opt_level"):
        env[neuron.OPT_LEVEL_VAR] = str(t.user_attrs["neuron_opt_level"])
    return env


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


def constants(config: dict[str, Any]) -> dict[str, Any]:
    """The trial's config as the exported file's constants: every key but the machine's and the kit's."""
    return {k.upper(): v for k, v in config.items() if k not in SUBMISSION and k not in RETIRED_KEYS}


def constants_block(meta: dict[str, Any], hyper: dict[str, Any]) -> str:
    """``NAME = literal`` lines: the trial's identity, then HYPERPARAMETERS and one constant per key."""
    lines = [f"{k} = {v!r}" for k, v in meta.items()]
    lines.append(f"HYPERPARAMETERS = {tuple(hyper)!r}  # the trainer's keys below, upper-cased")
    lines += [f"{k} = {v!r}" for k, v in hyper.items()]
    return "\n".join(lines)


def export(spec: Any, study_name: str, t: Any, out_dir: Path, budget_s: float = COMPETITION_BUDGET_S,
           root: Path = bundle.REPO_ROOT) -> dict[str, Any]:
    """Write train.py, launch.sh and provenance.json for trial ``t``; returns the provenance and warnings."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"--out {out_dir}: exists and is not a directory")
    if spec.script is not None:
        return export_script(spec, study_name, t, out_dir, root)
    trained_ranks, lnc, flags = launch_shape(spec, t)
    ranks = CHIP_CORES // lnc
    trained_config = record_config(t) or {}
    config = submission_config(trained_config, budget_s)
    try:  # what train.py would refuse at start-up, refused here (the model itself evaluates at any length)
        parsed = parse_config({k: v for k, v in config.items() if k != "vocab_size"})
        resolve_batch(parsed, ranks)
    except ConfigError as e:
        raise ExportError(f"trial {t.number}: train.py would refuse its configuration at {ranks} ranks: {e}") from None
    launch_env = launch_env_of(flags, t)
    version = code_version(root)
    trained_version = {k: t.user_attrs[k] for k in ("git_commit", "git_dirty") if k in t.user_attrs}
    warnings = []
    matches = _code_matches(version, trained_version)
    if matches is False:
        warnings.append(f"trial {t.number} ran code at commit {trained_version['git_commit'][:12]}; this export "
                        f"bundles {version['git_commit'][:12]}")
    if trained_ranks != ranks and not config.get("total_batch_tokens"):
        warnings.append(f"trial {t.number} ran on {trained_ranks} rank(s); the competition launches {ranks} at LNC "
                        f"{lnc}, so each step reads {ranks / trained_ranks:g} times the trial's batch")

    modules = bundle.collect(root)
    # A single study's value is val_bpb; a composite or pareto study's val_bpb is the record's.
    val_bpb = t.value if spec.objective.kind == "single" else t.user_attrs.get("val_bpb")
    values = dict(zip(spec.objective.names, t.values or (), strict=False))
    info = {"study": study_name, "trial": t.number, "val_bpb": val_bpb,
            "trained_budget_s": trained_config.get("budget_s"), "trained_device": t.user_attrs.get("device"),
            "version": version, "lnc": lnc, "launch": launch_line(ranks, lnc),
            "exported_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    meta = {"STUDY": study_name, "TRIAL": t.number, "RECORDED_VAL_BPB": val_bpb,
            "TRAINED_RANKS": trained_ranks, "TRAINED_LNC": lnc, "LAUNCH": info["launch"], "LAUNCH_ENV": launch_env,
            "CODE_VERSION": version.get("git_commit", "unknown") + (" (uncommitted changes)"
                                                                   if version.get("git_dirty") else ""),
            "EXPORTED_AT": info["exported_at"],
            # --max-train-seconds' default: None, the kit's TRAIN_TIME_BUDGET_SECONDS, unless --budget-s said otherwise
            "MAX_TRAIN_SECONDS": None if budget_s == COMPETITION_BUDGET_S else float(budget_s)}
    hyper = constants(trained_config)
    text, encoding = bundle.render(*train_program(meta, hyper), modules)
    data = text.encode("utf-8")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "train.py").write_bytes(data)
    inference, _ = bundle.render(*inference_program(info), modules)
    (out_dir / "inference.py").write_text(inference)
    sh = out_dir / "launch.sh"
    sh.write_text(fill("launch.sh", {"study": study_name, "trial": t.number, "launch": info["launch"]}))
    sh.chmod(0o755)
    provenance = {
        "study": study_name, "trial": t.number, "params": dict(t.params), "val_bpb": val_bpb, "values": values,
        "objective": spec.objective.describe(),
        "trained_budget_s": info["trained_budget_s"], "trained_device": info["trained_device"],
        "budget_s": float(budget_s), "config": config,
        "submission_keys": {k: why for k, (_, why) in SUBMISSION.items()}, "flag_defaults": FLAG_DEFAULTS,
        "launch": info["launch"], "ranks": ranks, "trained_ranks": trained_ranks, "lnc": lnc,
        "launch_env": launch_env, "eval_public": eval_public_line(config),
        "constants": hyper,
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


def export_script(spec: Any, study_name: str, t: Any, out_dir: Path, root: Path = bundle.REPO_ROOT
                  ) -> dict[str, Any]:
    """A trial of a study of a script: the team's script with the trial's constants (only those literals
    differ from the file), launch.sh and provenance.json. The script must be the one the trial ran."""
    script = spec.script
    if getattr(script, "dialect", "autoresearch") == "kit":
        ranks, lnc, flags = competition_shape(spec, t)
    else:
        ranks, lnc, flags = launch_shape(spec, t)
    ran = t.user_attrs.get("script_sha256")
    now = hashlib.sha256(script.script.read_bytes()).hexdigest()
    if ran and ran != now:
        raise ExportError(f"{script.script} changed since trial {t.number} ran it (sha256 {now[:12]}, the trial's "
                          f"{ran[:12]}): export writes its constants into the file as it is; restore that version")
    flat = spec.space.trainer_config(t.params)
    data = script.rewritten(flat).encode("utf-8")
    warnings = []
    if len(data) > bundle.UPLOAD_LIMIT_BYTES:
        warnings.append(f"train.py is {len(data):,} bytes, over the upload limit of {bundle.UPLOAD_LIMIT_BYTES:,}")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "train.py").write_bytes(data)
    knob_env = script.launch_env(flat) if hasattr(script, "launch_env") else {}
    if knob_env:  # a knob read from the environment cannot be baked into the file: it goes on the launch line
        warnings.append("the environment knobs " + ", ".join(sorted(knob_env)) + " cannot be baked into train.py; "
                        "launch.sh sets them")
    launch = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(knob_env.items())) + (" " if knob_env else "") + \
        launch_line(ranks, lnc)
    sh = out_dir / "launch.sh"
    sh.write_text(fill("launch.sh", {"study": study_name, "trial": t.number, "launch": launch}))
    sh.chmod(0o755)
    val_bpb = t.value if spec.objective.kind == "single" else t.user_attrs.get("val_bpb")
    provenance = {
        "study": study_name, "trial": t.number, "params": dict(t.params), "val_bpb": val_bpb,
        "values": dict(zip(spec.objective.names, t.values or (), strict=False)),
        "objective": spec.objective.describe(), "script": str(script.script), "script_sha256": now,
        "constants": script.trainer_config(flat)["constants"], "trained_budget_s": t.user_attrs.get("budget_s"),
        "launch": launch, "ranks": ranks, "lnc": lnc, "launch_env": launch_env_of(flags, t),
        "code_version": code_version(root), "spec_hash": t.user_attrs.get("spec_hash"),
        "train_py_sha256": hashlib.sha256(data).hexdigest(), "train_py_bytes": len(data),
        "upload_limit_bytes": bundle.UPLOAD_LIMIT_BYTES,
        "exported_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    (out_dir / "provenance.json").write_text(json.dumps(provenance, indent=1, default=str) + "\n")
    return {"provenance": provenance, "warnings": warnings}


# -- the generated files ---------------------------------------------------------------------------

TEMPLATES = Path(__file__).with_name("templates")  # the exported programs, as files a reader and ruff can see
BUNDLE_MARK = "# ==== the import hook and the bundled packages go here (sweep/ship/bundle.py) ====\n"
# $$, a quoted "$NAME" (a Python literal where the template's code needs an expression), $name (text), a stray $.
_PLACEHOLDER = re.compile(r'\$\$|"\$([A-Z_]+)"|\$([a-z_]+)|\$')


def template(name: str) -> str:
    """Template ``name``'s text without its note (everything up to the first blank line)."""
    return (TEMPLATES / name).read_text(encoding="utf-8").split("\n\n", 1)[1]


def fill(name: str, text: dict[str, Any], literals: dict[str, str] | None = None, source: str | None = None) -> str:
    """Template ``name`` (or ``source``, a part of it) with its placeholders replaced: ``$name`` by
    ``str(text[name])``, a quoted ``"$NAME"`` by ``literals[NAME]`` (Python source), ``$$`` by ``$``."""
    literals = literals or {}

    def one(m: re.Match[str]) -> str:
        if m[0] == "$$":
            return "$"
        if m[1]:
            return literals[m[1]]
        if m[2]:
            return as_text(name, str(text[m[2]]))
        raise ValueError(f"{TEMPLATES / name}: a $ that is no placeholder (write $$ for a dollar sign)")

    return _PLACEHOLDER.sub(one, template(name) if source is None else source)


def as_text(name: str, value: str) -> str:
    """``value`` made inert where a text placeholder of template ``name`` sits: in a Python template (text
    goes in docstrings) backslashes, double quotes and control characters are escaped, so no value closes
    the docstring and it still reads the same; in a shell script control characters become spaces, so a
    value stays on its comment's (or the launch line's) line."""
    if name.endswith(".py"):
        value = value.replace("\\", "\\\\").replace('"', '\\"')
        return "".join(c if c == "\n" or c.isprintable() else f"\\x{ord(c):02x}" if ord(c) < 256
                       else f"\\u{ord(c):04x}" if ord(c) < 0x10000 else f"\\U{ord(c):08x}" for c in value)
    return "".join(c if c.isprintable() else " " for c in value)


def fill_around_bundle(name: str, text: dict[str, Any], literals: dict[str, str] | None = None) -> tuple[str, str]:
    """A program's text before and after its marked line, each filled: :func:`bundle.render` puts the import
    hook and the bundled packages between them."""
    head, mark, tail = template(name).partition("\n" + BUNDLE_MARK)
    if not mark or BUNDLE_MARK in tail:
        raise ValueError(f"{TEMPLATES / name}: needs the line {BUNDLE_MARK.strip()!r} exactly once")
    return fill(name, text, literals, head), fill(name, text, literals, tail)


def train_program(meta: dict[str, Any], hyper: dict[str, Any]) -> tuple[str, str]:
    """train.py before and after the bundle: the template with the constants block filled in, nothing else."""
    return fill_around_bundle("train.py", {}, {"CONSTANTS": constants_block(meta, hyper)})


def inference_program(info: dict[str, Any]) -> tuple[str, str]:
    """inference.py before and after the bundle."""
    text = {"study": info["study"], "trial": info["trial"], "commit": info["version"].get("git_commit", "unknown")}
    return fill_around_bundle("inference.py", text)

# The template of an exported train.py, filled by sweep/ship/export.py: $name is replaced by text, a quoted
# "$NAME" (quotes included) by a Python literal, $$ by a dollar sign; the import hook and the bundled packages
# (sweep/ship/bundle.py) take the marked line's place. This note, up to the first blank line, is not copied.

#!/usr/bin/env python3
"""Competition train.py exported by trnsweep: study $study, trial $trial (val_bpb $val in $trained_s s on $trained_on).

Launch, with no arguments:
    $launch
It trains the trial's configuration (CONFIG, at the end) with trnsweep's own trainer, bundled below with
the model and kernels packages exactly as the sweep ran them, for budget_s = $budget charged
seconds; writes out/final.pt and prints the summary block after a `---` line. load_for_eval(checkpoint_path,
device) returns the trained model for evaluation. Generated: re-export rather than edit.

Set for a submission instead of copied from the sweep's machine (everything else is the trial's record):
    budget_s = $budget_repr: the competition's charged training time
$set_keys
The kit's prepare.py is looked for in $$$kit_env, beside this file, in the working directory, then on
sys.path. To run elsewhere, $overrides_env takes a JSON object merged over CONFIG, e.g.
    $overrides_env='{"device": "cpu", "data": "demo", "budget_s": 10}' python train.py

Code: trnsweep $commit$dirty; exported $exported_at.
"""

import importlib.util
import json
import os
import sys

# The launch line carries only NEURON_LOGICAL_NC_CONFIG; the rest of the trial's launch environment is set
# here, before torch loads, unless the caller set it.
LAUNCH_ENV = "$LAUNCH_ENV"
for _key, _value in LAUNCH_ENV.items():
    os.environ.setdefault(_key, _value)

# ==== the import hook and the bundled packages go here (sweep/ship/bundle.py) ====

# ---- the submission ---------------------------------------------------------------------------

from model.train import load_for_eval  # noqa: E402,F401  (the evaluation's entry point)

CONFIG = "$CONFIG"
TRAINED_LNC = "$TRAINED_LNC"
OUT_DIR = "out"
KIT_ENV = "$KIT_ENV"
OVERRIDES_ENV = "$OVERRIDES_ENV"


def _fail(message):
    print(f"train.py: {message}", file=sys.stderr, flush=True)
    return 2


def find_kit():
    """The kit's prepare.py: $$$kit_env, beside this file, in the working directory, or on sys.path."""
    if os.environ.get(KIT_ENV):
        return os.environ[KIT_ENV]
    here = os.path.dirname(os.path.abspath(globals().get("__file__") or "train.py"))
    for folder in (here, os.getcwd()):
        if os.path.isfile(os.path.join(folder, "prepare.py")):
            return os.path.join(folder, "prepare.py")
    found = importlib.util.find_spec("prepare")
    return found.origin if found is not None and found.origin and os.path.isfile(found.origin) else None


def resolved_config():
    """CONFIG, with $$$overrides_env merged over it and the kit located; None (after one line) when impossible."""
    config = dict(CONFIG)
    raw = os.environ.get(OVERRIDES_ENV, "").strip()
    if raw:
        try:
            extra = json.loads(raw)
        except ValueError as e:
            _fail(f"{OVERRIDES_ENV} is not JSON: {e}")
            return None
        if not isinstance(extra, dict):
            _fail(f"{OVERRIDES_ENV} must be a JSON object of config keys, got {raw[:80]!r}")
            return None
        config.update(extra)
    if config.get("data") == "kit":
        kit = find_kit()
        if kit is None:
            _fail("the competition kit's prepare.py was not found (set " + KIT_ENV + " or put it beside train.py); "
                  + OVERRIDES_ENV + "='{\"data\": \"demo\"}' trains on the demo corpus instead")
            return None
        config["data"] = "kit:" + kit
    return config


def main():
    config = resolved_config()
    if config is None:
        return 2
    lnc = os.environ.get("NEURON_LOGICAL_NC_CONFIG")
    if config.get("device") == "neuron" and lnc != str(TRAINED_LNC):
        print(f"train.py: warning: NEURON_LOGICAL_NC_CONFIG={lnc}, the sweep trained this at {TRAINED_LNC}",
              file=sys.stderr, flush=True)
    from model import train as trainer

    return trainer.main(["--config", json.dumps(config), "--out-dir", OUT_DIR, "--competition"])


if __name__ == "__main__":
    exit_code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)  # as model.train does: everything is written; skip unloading torch

# The template of an exported inference.py, filled by sweep/ship/export.py: $name is replaced by text; the
# import hook and the bundled packages (sweep/ship/bundle.py) take the marked line's place. This note, up to
# the first blank line, is not copied.

#!/usr/bin/env python3
"""Phase-2 inference.py exported by trnsweep beside train.py (study $study, trial $trial).

Scores CORE on the checkpoint train.py wrote, with the same model code and evaluation the sweep used
(trnsweep's model.inference, bundled below):
    python inference.py --checkpoint out/final.pt --bundle EVAL_BUNDLE_DIR [--max-seconds 3600] --json
Under torchrun the examples are shared across ranks. Code: trnsweep $commit.
"""

import os
import sys

# ==== the import hook and the bundled packages go here (sweep/ship/bundle.py) ====

# ---- the entry point ----------------------------------------------------------------------------

from model.inference import main  # noqa: E402
from model.train import load_for_eval  # noqa: E402,F401

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

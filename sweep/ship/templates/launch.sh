# The template of an exported launch.sh, filled by sweep/ship/export.py: $name is replaced by text. This
# note, up to the first blank line, is not copied.

#!/bin/sh
# Study $study, trial $trial: the competition's launch line, run from the directory holding train.py.
$launch

import sys

from sweep.cli import entry

sys.exit(entry())

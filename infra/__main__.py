"""``python -m infra ...``: see :mod:`infra.cli`."""

from infra.cli import main

raise SystemExit(main())

"""``python -m sweep.store proxy --host H --port P``: the gRPC proxy process that StorageProxy starts."""

import sys

from sweep.store.proxy import main

sys.exit(main())

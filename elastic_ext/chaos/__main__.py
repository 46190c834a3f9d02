"""``python -m elastic_ext.chaos``: the chaos command without the ``elastic-ext`` wrapper."""

import sys

from elastic_ext.chaos.cli import main

sys.exit(main())

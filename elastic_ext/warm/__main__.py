"""``python -m elastic_ext.warm (-m MODULE | SCRIPT) [ARGS...]``: see ``launcher``."""

import sys

from elastic_ext.warm.launcher import main

sys.exit(main())

"""``python -m ray_rdt_pool.memory.native build | path``: see
:func:`ray_rdt_pool.memory.native.main`."""

import sys

from ray_rdt_pool.memory.native import main

sys.exit(main())

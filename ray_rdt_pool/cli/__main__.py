"""``python -m ray_rdt_pool.cli``: the ``ray-rdt-pool`` command without its script."""

import sys

from ray_rdt_pool.cli import main

sys.exit(main())

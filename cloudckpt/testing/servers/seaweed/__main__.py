"""``python -m cloudckpt.testing.servers.seaweed``: see :mod:`.cli`."""

import sys

from cloudckpt.testing.servers.seaweed.cli import main

sys.exit(main())

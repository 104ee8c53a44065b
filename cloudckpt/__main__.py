"""``python -m cloudckpt``: the ``cloudckpt`` command (see :mod:`cloudckpt.cli`)."""

import sys

from cloudckpt.cli import main

sys.exit(main())

"""``python -m cloudckpt``: the ``cloudckpt`` command (see :mod:`cloudckpt.cli.main`)."""

import sys

from cloudckpt.cli.main import main

sys.exit(main())

"""cloudckpt: distributed PyTorch checkpoints on S3-compatible object stores."""

__version__ = "0.1.0"

from cloudckpt import errors  # noqa: E402,F401
from cloudckpt.errors import *  # noqa: E402,F401,F403

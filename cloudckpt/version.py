"""The version of cloudckpt (ground: imported by the manifest writers and the command line)."""

__version__ = "0.1.0"

"""dist."""

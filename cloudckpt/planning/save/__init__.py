"""save."""

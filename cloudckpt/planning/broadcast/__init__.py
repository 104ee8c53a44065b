"""broadcast."""

"""statedict."""

"""Reliability and security suite: crash consistency, store faults, corruption, hostile manifests,
concurrency, secrets. See docs/reliability.md for the guarantees each module proves."""

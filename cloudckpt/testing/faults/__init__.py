"""Broken S3 endpoints for tests: a fault-injecting proxy, a proxy that lies about ranged
answers, and dead ends (a closed port, a server that never answers, one that trickles)."""

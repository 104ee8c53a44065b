"""S3 servers for tests, examples and benchmarks: SeaweedFS (``seaweed/``), moto (a second S3
implementation), where a running endpoint is (``endpoint``), a private TLS CA, a fake EC2
metadata service."""

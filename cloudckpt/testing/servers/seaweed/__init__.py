"""SeaweedFS (``weed mini``) as a throwaway local S3 endpoint with real credentials.

`server` (S3Server, start_s3_server: the contract), `config` (what one start of weed is told),
`host` (binary, free ports, bucket names, listen address, stopping), `watchdog` (a plain script
that stops weed when its owner dies), `cli` (``python -m cloudckpt.testing.servers.seaweed``).
"""

"""``S3Store`` on aiobotocore: the store (``store``), the one request choke point
(``conn``: retries, logging, error translation), writes, uploads, streams, reads, the direct
ranged-GET reader (``rangeget``, ``exchange``), answer checks, errors, client and its config,
and the typed boundary to the untyped client (``shapes``)."""

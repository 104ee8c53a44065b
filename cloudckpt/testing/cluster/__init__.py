"""A simulated cluster for tests: nodes as network namespaces with shaped links (``simulated``,
``net``), its S3 server (``s3``) and the watchdog that removes everything when the owner dies."""

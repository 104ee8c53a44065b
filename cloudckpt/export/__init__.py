"""A checkpoint written out in another format (interop band): one ``.safetensors`` / ``.pt`` file
(``file``), a Hugging Face folder window by window (``folder``, planned purely by ``shards``,
written through ``destinations``: never over an existing name). Reads through ``api/`` only."""

"""torch DCP on cloudckpt's storage: a ``StorageWriter`` and a ``StorageReader`` for
``torch.distributed.checkpoint`` (``dcp.save``, ``dcp.load``, ``dcp.async_save``) that write and
read DCP's own layout in S3 (or a local folder) through cloudckpt's store, with crc32c checks,
and conversion between DCP and cloudckpt checkpoints.

```python
import torch.distributed.checkpoint as dcp
from cloudckpt.dcp import StorageReader, StorageWriter
dcp.save(state_dict, storage_writer=StorageWriter("s3://bucket/run/step-100"))
dcp.load(state_dict, storage_reader=StorageReader("s3://bucket/run/step-100"))
```

Importing this package imports torch. See :mod:`cloudckpt.dcp.writer`,
:mod:`cloudckpt.dcp.reader` and :mod:`cloudckpt.dcp.convert`.
"""

from cloudckpt.dcp.options import DCPOptions
from cloudckpt.dcp.reader import StorageReader
from cloudckpt.dcp.writer import StorageWriter

__all__ = ["DCPOptions", "StorageReader", "StorageWriter", "convert"]


def __getattr__(name: str):
    if name == "convert":
        from cloudckpt.dcp.convert import convert

        return convert
    raise AttributeError(f"module 'cloudckpt.dcp' has no attribute {name!r}")

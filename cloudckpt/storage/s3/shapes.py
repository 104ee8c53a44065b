"""The typed boundary to aiobotocore (which ships no types): the S3 operations the store sends
(:data:`S3Method`), the fields of their answers it reads (:class:`S3Answer`), and the parts of
the client object it touches (:class:`S3Client`). Only what cloudckpt uses is described; a field
botocore may leave out is optional (``total=False``), as in botocore's own output shapes.
"""

from __future__ import annotations

from collections.abc import Awaitable
from datetime import datetime
from typing import Any, Literal, Protocol, TypedDict

#: The client methods ``S3Connection.send`` / ``request`` call (botocore's snake_case names).
S3Method = Literal[
    "abort_multipart_upload",
    "complete_multipart_upload",
    "create_multipart_upload",
    "delete_object",
    "delete_objects",
    "get_object",
    "head_object",
    "list_multipart_uploads",
    "list_objects_v2",
    "put_object",
    "upload_part",
]


class CompletedPart(TypedDict, total=False):
    """One entry of CompleteMultipartUpload's part list."""

    PartNumber: int
    ETag: str
    ChecksumCRC32C: str


class S3Params(TypedDict, total=False):
    """The request parameters cloudckpt sends (``Bucket`` is added by ``S3Connection.send``)."""

    Key: str
    Body: bytes
    Range: str
    Prefix: str
    MaxKeys: int
    Delimiter: str
    ContinuationToken: str
    KeyMarker: str
    UploadIdMarker: str
    UploadId: str
    PartNumber: int
    MultipartUpload: dict[str, list[CompletedPart]]
    Metadata: dict[str, str]
    IfNoneMatch: str
    ChecksumCRC32C: str
    ChecksumAlgorithm: str
    ChecksumMode: str
    Delete: dict[str, object]


class StreamingBody(Protocol):
    """The ``Body`` of a GetObject answer (aiobotocore's ``StreamingBody``)."""

    async def read(self, amt: int = ..., /) -> bytes: ...

    def close(self) -> None: ...


class ResponseMetadata(TypedDict, total=False):
    HTTPStatusCode: int


class ListedObject(TypedDict, total=False):
    """One entry of ListObjectsV2's ``Contents``."""

    Key: str
    Size: int
    ETag: str
    LastModified: datetime


class ListedPrefix(TypedDict):
    """One entry of ListObjectsV2's ``CommonPrefixes``."""

    Prefix: str


class ListedUpload(TypedDict, total=False):
    """One entry of ListMultipartUploads' ``Uploads``."""

    Key: str
    UploadId: str
    Initiated: datetime


class DeleteError(TypedDict, total=False):
    """One entry of DeleteObjects' ``Errors``."""

    Key: str
    Code: str
    Message: str


class S3Answer(TypedDict, total=False):
    """The fields of S3 answers that cloudckpt reads (each operation fills its own)."""

    ResponseMetadata: ResponseMetadata
    ETag: str
    ContentLength: int
    ContentRange: str
    LastModified: datetime
    Metadata: dict[str, str]
    ChecksumCRC32C: str
    ChecksumType: str
    ServerSideEncryption: str
    SSECustomerAlgorithm: str
    Body: StreamingBody
    UploadId: str
    Contents: list[ListedObject]
    CommonPrefixes: list[ListedPrefix]
    IsTruncated: bool
    NextContinuationToken: str
    Uploads: list[ListedUpload]
    NextKeyMarker: str
    NextUploadIdMarker: str
    Errors: list[DeleteError]


class ConfigSession(Protocol):
    """The parts of a botocore (or aiobotocore) session that ``aws_config`` reads. Config values
    are botocore's, untyped (strings, booleans, nested sections): read, never passed on blindly."""

    @property
    def profile(self) -> str | None: ...

    @property
    def full_config(self) -> dict[str, Any]: ...

    def get_config_variable(self, logical_name: str) -> Any: ...

    def get_scoped_config(self) -> dict[str, Any]: ...


class ClientConfig(Protocol):
    @property
    def s3(self) -> dict[str, str] | None: ...


class OperationModel(Protocol):
    @property
    def output_shape(self) -> object: ...


class ServiceModel(Protocol):
    """botocore's ``ServiceModel`` (to parse an error answer as botocore would)."""

    def operation_model(self, operation_name: str) -> OperationModel: ...


class ClientMeta(Protocol):
    """``client.meta``: the parts of botocore's ``ClientMeta`` that cloudckpt reads."""

    @property
    def endpoint_url(self) -> str: ...

    @property
    def region_name(self) -> str | None: ...

    @property
    def config(self) -> ClientConfig: ...

    @property
    def service_model(self) -> ServiceModel: ...


class S3Client(Protocol):
    """The aiobotocore S3 client as cloudckpt uses it: requests go through
    ``S3Connection.send`` (by method name), presigned URLs through the direct reader."""

    @property
    def meta(self) -> ClientMeta: ...

    def generate_presigned_url(
        self, ClientMethod: str, Params: dict[str, object], ExpiresIn: int = ...
    ) -> Awaitable[str]: ...

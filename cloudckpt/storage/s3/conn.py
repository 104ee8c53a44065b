"""What an ``S3Store`` and its children share: the aiobotocore client, the request choke point,
the concurrency slots, the byte budget and the counters.

``S3Connection.call`` is the one way a request reaches the server: it holds a request slot for
each attempt and owns retries, per-attempt caps, the operation's deadline, logging and error
translation (``retry.Retrier`` with ``s3_errors.classify``). A plain request is one line,
``await conn.request("head_object", op="head", key=key, where=url, Key=phys)`` (``call`` around
one ``send``); only attempts that do more than send one request (read a streamed body, inspect
an answer and retry part of it) pass their own ``attempt`` to ``call``, sending with ``send``.
``S3Connection.reserve`` takes buffer memory from the byte budget under the same deadline. The
write and read halves of the store (``uploads.S3Uploads`` / ``write.S3Writer``,
``read.S3Reader``) use only this public interface.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from cloudckpt.errors import StorageError
from cloudckpt.storage.base import ByteBudget, StoreStats
from cloudckpt.storage.options import StorageOptions
from cloudckpt.storage.retry import Retrier, Verdict
from cloudckpt.storage.s3.aws_config import endpoint_source, is_aws_endpoint
from cloudckpt.storage.s3.client import BodyPayload, open_client, send_with_body
from cloudckpt.storage.s3.errors import Endpoint, classify
from cloudckpt.storage.s3.rangeget import RangeGetter
from cloudckpt.storage.s3.shapes import S3Answer, S3Client, S3Method, S3Params
from cloudckpt.storage.spreading import Spreader

if TYPE_CHECKING:
    from typing_extensions import Unpack
T = TypeVar("T")


class S3Connection:
    """One per ``open_store`` call; ``child()`` stores share it.

    Public state: ``options``; ``bucket``; ``anchor`` (the key prefix of the URL given to
    ``open_store``: "" or ".../"); ``stats``; ``spreader`` (prefix spreading); ``slots`` (at most
    ``options.concurrency`` requests in flight); ``budget`` (``options.max_buffer_bytes`` of
    store-owned read buffers and stream parts in flight); ``endpoint`` (where requests go and
    as whom, for messages: an ``s3_errors.Endpoint``, completed when the client is created);
    ``create_strategy`` (``"native"``, ``"fallback"`` or None until the conditional-create
    probe ran) with ``create_lock`` serialising that probe; what the server was found not to
    implement: ``batch_delete`` (False once DeleteObjects was refused: single deletes from then
    on) and ``lists_uploads`` (False once ListMultipartUploads answered 501); ``range_getter``, the
    direct ranged-GET reader (``s3_rangeget``) with its kept-alive connections.
    """

    def __init__(self, options: StorageOptions, bucket: str, anchor: str):
        self.options = options
        self.bucket = bucket
        self.anchor = anchor
        self.stats = StoreStats()
        self.spreader = Spreader(options.prefix_spreading)
        self.slots = asyncio.Semaphore(options.concurrency)
        self.budget = ByteBudget(options.max_buffer_bytes)
        url, source = endpoint_source(options)
        self.endpoint = Endpoint(
            url=url,
            source=source,
            aws=url is None or is_aws_endpoint(url),
            access_key_id=options.access_key_id,
        )
        self._retrier = Retrier(
            options=options.retry,
            stats=self.stats,
            slots=self.slots,
            classify=self._classify,
            describe=self.describe_endpoint,
        )
        self.create_strategy: str | None = (
            None if options.conditional_create == "auto" else options.conditional_create
        )
        self.create_lock = asyncio.Lock()
        self.batch_delete: bool | None = None
        self.lists_uploads: bool | None = None
        self.range_getter = RangeGetter(options, self.stats)
        self._client: S3Client | None = None
        self._client_lock = asyncio.Lock()
        self._stack: contextlib.AsyncExitStack | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._background: set[asyncio.Task[None]] = set()

    async def client(self) -> S3Client:
        """The aiobotocore client, created on first use in the running loop."""
        loop = asyncio.get_running_loop()
        if self._client is not None:
            if loop is not self._loop:
                raise StorageError("an S3Store is bound to the event loop it was first used on")
            return self._client
        if self._closed:
            raise StorageError("the store is closed")
        async with self._client_lock:
            if self._client is None:
                stack = contextlib.AsyncExitStack()
                try:
                    client, access_key_id, source = await open_client(self.options, stack)
                except BaseException:
                    await stack.aclose()
                    raise
                url = client.meta.endpoint_url
                self.endpoint = Endpoint(
                    url=url, source=source, aws=is_aws_endpoint(url), access_key_id=access_key_id
                )
                self._client, self._stack, self._loop = client, stack, loop
        return self._client

    def refuses_batch_delete(self) -> bool:
        """Remember that the server refuses DeleteObjects; True only the first time (one log)."""
        first, self.batch_delete = self.batch_delete is not False, False
        return first

    def refuses_upload_listing(self) -> bool:
        """Remember that ListMultipartUploads is not implemented; True only the first time."""
        first, self.lists_uploads = self.lists_uploads is not False, False
        return first

    def describe_endpoint(self) -> str:
        """Where this store's requests go, for messages (see ``s3_errors.Endpoint``)."""
        return self.endpoint.describe()

    def _classify(self, exc: BaseException, op: str, key: str | None, name: str) -> Verdict:
        return classify(exc, op, key, name, self.endpoint)

    # --- the choke point ------------------------------------------------------------------------

    def deadline(self) -> float:
        """The retry deadline (event loop time) of an operation starting now."""
        return self._retrier.deadline()

    async def call(
        self,
        op: str,
        key: str | None,
        attempt: Callable[[int], Awaitable[T]],
        *,
        where: str,
        deadline: float | None = None,
    ) -> T:
        """Run one request: ``attempt(n)`` (n = 1, 2, ...; it fetches ``client()`` and sends
        one request) under a request slot, retried per ``options.retry`` until it returns or
        fails for good; failures raise ``cloudckpt.errors`` classes. ``op`` names the operation
        in stats and logs, ``key`` the store-relative key (or None), ``where`` the store URL.
        ``deadline``: that of an operation started earlier (:meth:`deadline`); by default the
        request starts its own. Waiting for a slot counts against it (``retry.py``)."""
        return await self._retrier.call(op, key, attempt, where=where, deadline=deadline)

    async def request(
        self,
        method: S3Method,
        *,
        op: str,
        key: str | None,
        where: str,
        deadline: float | None = None,
        body: Sequence[memoryview] | None = None,
        on_attempt: Callable[[int], None] | None = None,
        **params: Unpack[S3Params],
    ) -> S3Answer:
        """One plain request through :meth:`call`: each attempt is one :meth:`send` of
        ``method`` with ``params`` (and ``body``). ``on_attempt(n)`` is told each attempt's
        number as it starts (a caller whose recovery depends on whether it was retried)."""

        async def attempt(n: int) -> S3Answer:
            if on_attempt is not None:
                on_attempt(n)
            return await self.send(method, body=body, **params)

        return await self.call(op, key, attempt, where=where, deadline=deadline)

    async def send(
        self,
        method: S3Method,
        *,
        body: Sequence[memoryview] | None = None,
        **params: Unpack[S3Params],
    ) -> S3Answer:
        """Send one request (no retry: inside an attempt of :meth:`call`) to the bucket.
        ``body``: buffers sent as one zero-copy body with its ``ContentLength``, watched for a
        stalled upload (``s3_client.send_with_body``) and counted in ``stats.bytes_sent``."""
        client = await self.client()
        # aiobotocore's methods are generated at run time (untyped): the boundary is S3Answer
        operation: Callable[..., Coroutine[Any, Any, S3Answer]] = getattr(client, method)
        if body is None:
            return await operation(Bucket=self.bucket, **params)
        size = sum(len(v) for v in body)
        payload: BodyPayload | bytes = BodyPayload(body) if size else b""
        answer = await send_with_body(
            operation(Bucket=self.bucket, ContentLength=size, Body=payload, **params),
            payload,
            self.options.retry.read_timeout,
        )
        self.stats.bytes_sent += size
        return answer

    async def reserve(
        self, nbytes: int, *, op: str, key: str | None, where: str, deadline: float
    ) -> int:
        """Take ``nbytes`` (clipped to the limit) of the byte budget, waiting at most until
        ``deadline`` (then ``RetriesExhausted``, as for a request out of time). Returns the
        amount to give back with ``budget.release``."""
        got = self.budget.try_acquire(nbytes)
        if got is not None:
            return got
        return await self._retrier.wait(
            self.budget.acquire(nbytes),
            what="buffer memory",
            op=op,
            key=key,
            where=where,
            deadline=deadline,
        )

    # --- lifetime -------------------------------------------------------------------------------

    def in_background(self, coro: Awaitable[None]) -> None:
        """Run ``coro`` (a cleanup) to completion even if the caller is cancelled; ``close``
        waits for it."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        self._closed = True
        if self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)
        self.range_getter.close()
        stack, self._stack, self._client = self._stack, None, None
        if stack is not None:
            await stack.aclose()

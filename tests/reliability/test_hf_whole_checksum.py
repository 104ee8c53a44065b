"""A safetensors file is checked against the checksum its store holds of the whole object
(issue 28): safetensors carries no checksum, but S3 keeps a full-object CRC32C when the file was
stored with one, and the ETag of a single-part upload is its MD5. On the real SeaweedFS, through
a fault proxy that flips one bit of a data GET's body: a load that reads the whole file raises
the typed ``ChecksumError`` on every kind of stored checksum; a load of part of a file is not
checked (documented: the damaged bytes land). See docs/reliability.md, section 33.
"""

from __future__ import annotations

import base64

import pytest
import torch

import cloudckpt
from cloudckpt.checksum import crc32c
from cloudckpt.errors import ChecksumError
from cloudckpt.hf.header import build_header
from cloudckpt.runtime.loop import run_coroutine, shared_store
from cloudckpt.storage import LocalStore
from tests.reliability.conftest import storage_for

N = 16 << 10  # elements per tensor (64 KiB each)


def safetensors_file() -> tuple[bytes, int, dict[str, torch.Tensor]]:
    """A file of two float32 tensors: its bytes, where its data starts, the tensors."""
    g = torch.Generator().manual_seed(7)
    tensors = {"a": torch.randn(N, generator=g), "b": torch.randn(N, generator=g)}
    head, header = build_header([(k, "float32", (N,)) for k in tensors])
    blob = head + b"".join(t.numpy().tobytes() for t in tensors.values())
    return blob, header.data_start, tensors


def upload(s3_server, url: str, blob: bytes, *, crc: bool) -> None:
    bucket_key = url.removeprefix(f"s3://{s3_server.bucket}/") + "/model.safetensors"
    extra = (
        {"ChecksumCRC32C": base64.b64encode(crc32c(blob).to_bytes(4, "big")).decode()}
        if crc
        else {}
    )
    s3_server.boto3_client().put_object(Bucket=s3_server.bucket, Key=bucket_key, Body=blob, **extra)


def flip_first_data_get(proxy, load, data_start: int) -> None:
    """Count the requests of a clean ``load()`` through ``proxy`` up to its first GET of data
    bytes, then schedule a bit flip on that request of the next load."""
    proxy.configure(record=True)
    load()
    requests = proxy.requests
    first = next(
        i
        for i, (method, _, headers) in enumerate(requests)
        if method == "GET"
        and headers.get("Range", headers.get("range", "")).startswith(f"bytes={data_start}-")
    )
    proxy.configure(record=False, schedule=[None] * first + ["flip"])


@pytest.mark.parametrize("stored", ["crc32c", "md5"])
def test_a_file_damaged_behind_the_stores_checksum_is_never_loaded(
    s3_server, s3_url, fault_proxy, stored
):
    blob, data_start, tensors = safetensors_file()
    upload(s3_server, s3_url, blob, crc=stored == "crc32c")
    options = storage_for(s3_server, endpoint_url=fault_proxy.endpoint_url)
    whole = run_coroutine(shared_store(s3_url, options).whole_checksum("model.safetensors"))
    assert whole is not None and whole.kind == stored and whole.size == len(blob)

    def load():
        state = {k: torch.zeros(N) for k in tensors}
        cloudckpt.load_safetensors(state, s3_url, storage=options)
        return state

    flip_first_data_get(fault_proxy, load, data_start)  # the clean load passes its check
    with pytest.raises(ChecksumError, match="do not match the") as caught:
        load()
    assert fault_proxy.counters.get("flip") == 1
    assert caught.value.key == "model.safetensors" and "\n" not in str(caught.value)
    got = load()  # nothing is wrong with the stored file: a clean read loads it
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)


def test_a_partial_load_is_not_checked(s3_server, s3_url, fault_proxy):
    """Reading one tensor of a file reads part of it: the store's checksum of the whole file
    cannot be checked, and a bit flipped in transit lands (what docs/guide.md says)."""
    blob, data_start, tensors = safetensors_file()
    upload(s3_server, s3_url, blob, crc=True)
    options = storage_for(s3_server, endpoint_url=fault_proxy.endpoint_url)

    def load():
        state = {"a": torch.zeros(N)}
        cloudckpt.load_safetensors(state, s3_url, storage=options, strict=False)
        return state

    flip_first_data_get(fault_proxy, load, data_start)
    got = load()
    assert fault_proxy.counters.get("flip") == 1
    assert not torch.equal(got["a"], tensors["a"])  # not verified: the damaged bit landed


def test_stores_without_a_whole_object_checksum(s3_server, s3_url, tmp_path):
    """A multipart upload's checksum is not of the whole object, a file keeps none: nothing to
    check, and the load reads as before."""
    blob, _, tensors = safetensors_file()
    client = s3_server.boto3_client()
    key = s3_url.removeprefix(f"s3://{s3_server.bucket}/") + "/model.safetensors"
    up = client.create_multipart_upload(Bucket=s3_server.bucket, Key=key)
    part = client.upload_part(
        Bucket=s3_server.bucket, Key=key, PartNumber=1, UploadId=up["UploadId"], Body=blob
    )
    client.complete_multipart_upload(
        Bucket=s3_server.bucket,
        Key=key,
        UploadId=up["UploadId"],
        MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]},
    )
    options = storage_for(s3_server)
    assert run_coroutine(shared_store(s3_url, options).whole_checksum("model.safetensors")) is None
    (tmp_path / "model.safetensors").write_bytes(blob)
    assert run_coroutine(LocalStore(tmp_path).whole_checksum("model.safetensors")) is None
    for src, storage in ((s3_url, options), (str(tmp_path), None)):
        state = {k: torch.zeros(N) for k in tensors}
        cloudckpt.load_safetensors(state, src, storage=storage)
        assert all(torch.equal(state[k], tensors[k]) for k in tensors)


@pytest.mark.parametrize("kind", ["crc32c", "md5"])
def test_ranges_in_any_order_are_folded_into_the_whole_files_checksum(tmp_path, kind):
    """``VerifyingStore`` over a real LocalStore, the expected checksum given: ranges read in
    reverse order and read twice still check a crc32c file (a damaged expectation raises); an
    MD5 can only be folded in file order, so that file goes unchecked, as documented."""
    import hashlib

    from cloudckpt.checksum import crc32c_combine
    from cloudckpt.hf.whole import ExpectedFile, VerifyingStore
    from cloudckpt.storage import ReadRange

    blob, data_start, _ = safetensors_file()
    (tmp_path / "f").write_bytes(blob)
    for a, b in ((blob[:5], blob[5:77]), (b"", blob[:9]), (blob, b"")):
        assert crc32c_combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b)
    good = crc32c(blob) if kind == "crc32c" else hashlib.md5(blob).digest()
    bad = good ^ 1 if kind == "crc32c" else bytes(16)
    cut = data_start + 1000
    tail = [ReadRange(cut, len(blob) - cut)]
    reverse = [
        tail,
        tail,
        [ReadRange(data_start, 10), ReadRange(data_start + 10, cut - 10 - data_start)],
    ]

    async def read(want, batches):
        store = VerifyingStore(
            LocalStore(tmp_path), {"f": ExpectedFile.of(kind, want, len(blob), blob[:data_start])}
        )
        for ranges in batches:
            await store.read_ranges("f", ranges)

    run_coroutine(read(good, reverse))
    if kind == "crc32c":
        with pytest.raises(ChecksumError, match="CRC32C"):
            run_coroutine(read(bad, reverse))
    else:
        run_coroutine(read(bad, reverse))  # out of order: not checked
        with pytest.raises(ChecksumError, match="MD5"):
            run_coroutine(read(bad, reverse[2:] + reverse[:1]))


def test_only_checksums_of_the_whole_object_are_taken():
    """What a HeadObject answer yields: a full-object CRC32C first, then an MD5 ETag of an
    unencrypted single-part upload; never a composite CRC, a multipart ETag, an SSE-KMS or
    SSE-C ETag (not MD5s) or a malformed value."""
    from cloudckpt.storage.s3.store import whole_checksum_of

    md5 = '"0123456789abcdef0123456789abcdef"'
    crc = base64.b64encode((0xDEADBEEF).to_bytes(4, "big")).decode()
    got = whole_checksum_of({"ContentLength": 9, "ChecksumCRC32C": crc, "ETag": md5})
    assert (got.kind, got.value, got.size) == ("crc32c", 0xDEADBEEF, 9)
    assert whole_checksum_of({"ETag": md5}).value == bytes.fromhex(md5.strip('"'))
    for resp in (
        {"ChecksumCRC32C": crc + "-3", "ChecksumType": "COMPOSITE"},
        {"ChecksumCRC32C": crc, "ChecksumType": "COMPOSITE"},
        {"ChecksumCRC32C": "not base64!"},
        {"ETag": '"abc-2"'},
        {"ETag": md5, "ServerSideEncryption": "aws:kms"},
        {"ETag": md5, "SSECustomerAlgorithm": "AES256"},
        {},
    ):
        assert whole_checksum_of(resp) is None, resp

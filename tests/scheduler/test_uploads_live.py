"""Encode on upload, end to end: the official `openai` client uploads an image to POST /v1/files
of a real E-PD deployment (instance processes, a real MM Store), chats about it by file id —
greedy tokens equal to the same chat carrying the image's bytes, the features read from the
store (E was not asked again) — gets and deletes it (then 404). Features gone from the store
while the file lives are recomputed from the kept bytes (same tokens). The gRPC UploadMedia and
`Media.file_id` do the same."""

import grpc
import openai
import pytest
import redis


from epdserve import Client  # noqa: E402
from epdserve.client import FileId  # noqa: E402
from epdserve.rpc import common_pb2, instance_pb2, instance_pb2_grpc, serve_pb2, serve_pb2_grpc  # noqa: E402
from tests.entrypoints.http_harness import RunningFront, data_url  # noqa: E402
from tests.scheduler.harness import image, instance_deployment  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def deployment(qwen2_vl_tiny):
    with instance_deployment(qwen2_vl_tiny, (("e0", "E"), ("pd0", "PD"))) as (sched, _, store):
        front = RunningFront(sched)
        try:
            yield sched, front, store
        finally:
            front.stop()


def _chat(oai, part, max_tokens=6):
    r = oai.chat.completions.create(model=oai.model_name, max_tokens=max_tokens, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is in this picture?"}, part]}],
        extra_body={"return_token_ids": True})
    return r


def _client(front):
    oai = openai.OpenAI(base_url=front.base_url, api_key="none", max_retries=0, timeout=120)
    oai.model_name = oai.models.list().data[0].id
    return oai


def _images_encoded(sched, iid) -> int:
    rec = sched.call(lambda: sched.server.registry.get(iid))
    with grpc.insecure_channel(rec.address) as ch:
        return instance_pb2_grpc.InstanceStub(ch).GetLoad(instance_pb2.GetLoadRequest(), timeout=10).load.images_encoded


def _tokens(r):
    return r.choices[0].token_ids if hasattr(r.choices[0], "token_ids") else r.model_extra["choices"][0]["token_ids"]


def test_openai_client_uploads_then_asks_by_file_id(deployment):
    sched, front, store = deployment
    img = image(41, 112, 84)
    with _client(front) as oai:
        up = oai.files.create(file=("cat.jpg", img, "image/jpeg"), purpose="vision")
        assert up.id.startswith("file-") and up.bytes == len(img) and up.filename == "cat.jpg"
        assert up.status == "processed" and up.purpose == "vision"
        assert oai.files.retrieve(up.id).id == up.id
        key = sched.call(lambda: sched.server.dispatcher.uploads.get("", up.id).key)
        assert sched.call(lambda: key in sched.server.dispatcher.stored)  # E answered the upload's encode
        encodes = {iid: _images_encoded(sched, iid) for iid in ("e0", "pd0")}
        assert encodes["e0"] >= 1  # the upload's encode ran on E
        by_url = _chat(oai, {"type": "image_url", "image_url": {"url": f"epdserve-file://{up.id}"}})
        by_part = _chat(oai, {"type": "file", "file": {"file_id": up.id}})
        carried = _chat(oai, {"type": "image_url", "image_url": {"url": data_url(img)}})
        # the features were read from the store: neither E nor PD encoded the image again
        assert {iid: _images_encoded(sched, iid) for iid in ("e0", "pd0")} == encodes
        assert _tokens(by_url) == _tokens(by_part) == _tokens(carried)
        vision = by_url.usage.prompt_tokens - _chat(oai, {"type": "text", "text": "x"}).usage.prompt_tokens
        assert vision > 0
        # features gone from the MM Store (never seen by PD) while the file lives: recomputed
        # from the kept bytes by PD itself, same tokens
        other = image(42, 112, 84)
        up2 = oai.files.create(file=("b.jpg", other, "image/jpeg"), purpose="vision")
        redis.Redis.from_url(store.url).flushall()
        encoded = _images_encoded(sched, "pd0")
        again = _chat(oai, {"type": "file", "file": {"file_id": up2.id}})
        assert _images_encoded(sched, "pd0") == encoded + 1
        assert _tokens(again) == _tokens(_chat(oai, {"type": "image_url", "image_url": {"url": data_url(other)}}))
        deleted = oai.files.delete(up.id)
        assert deleted.deleted and deleted.id == up.id
        with pytest.raises(openai.NotFoundError) as gone:
            _chat(oai, {"type": "file", "file": {"file_id": up.id}})
        with pytest.raises(openai.NotFoundError) as unknown:
            _chat(oai, {"type": "file", "file": {"file_id": "file-000000000000000000000000"}})
        with pytest.raises(openai.NotFoundError):
            oai.files.retrieve(up.id)
    assert "never uploaded by this caller, deleted, or expired" in gone.value.message
    assert "never uploaded by this caller, deleted, or expired" in unknown.value.message


def test_bad_uploads_are_400(deployment):
    _, front, _ = deployment
    with _client(front) as oai:
        with pytest.raises(openai.BadRequestError) as e:
            oai.files.create(file=("a.jpg", b"not an image at all", "image/jpeg"), purpose="vision")
        assert "not a readable image" in e.value.message or "image" in e.value.message
        with pytest.raises(openai.BadRequestError) as p:
            oai.files.create(file=("a.jpg", image(1), "image/jpeg"), purpose="fine-tune")
        assert p.value.body["param"] == "purpose"


def test_grpc_upload_and_file_id(deployment):
    sched, _, _ = deployment
    img = image(44, 96, 80)
    prompt = "Describe <|vision_start|><|image_pad|><|vision_end|> briefly."
    sampling = common_pb2.SamplingParams(max_tokens=6, temperature=0)
    with grpc.insecure_channel(sched.address) as ch:
        stub = serve_pb2_grpc.EPDServeStub(ch)
        up = stub.UploadMedia(serve_pb2.UploadMediaRequest(data=img, filename="x.jpg"), timeout=120)
        assert up.encoded and up.bytes == len(img) and up.num_tokens > 0
        assert stub.GetUpload(serve_pb2.UploadRef(file_id=up.file_id), timeout=10).file_id == up.file_id
        ref = stub.Generate(serve_pb2.GenerateRequest(prompt=prompt, media=[common_pb2.Media(file_id=up.file_id)],
                                                      sampling=sampling), timeout=120)
        carried = stub.Generate(serve_pb2.GenerateRequest(prompt=prompt, media=[common_pb2.Media(data=img)],
                                                          sampling=sampling), timeout=120)
        assert list(ref.token_ids) == list(carried.token_ids)
        assert ref.usage.cached_vision_tokens == ref.usage.vision_tokens == up.num_tokens
        with Client(sched.address, timeout=120) as c:  # the Python client: FileId, and a chat's file part
            assert c.get_upload(up.file_id).file_id == up.file_id
            assert c.generate(prompt, images=[FileId(up.file_id)], max_tokens=6).token_ids == list(carried.token_ids)
            chat = [{"role": "user", "content": [{"type": "text", "text": "Describe"},
                                                 {"type": "file", "file": {"file_id": up.file_id}}]}]
            by_url = [{"role": "user", "content": [{"type": "text", "text": "Describe"}, {
                "type": "image_url", "image_url": {"url": f"epdserve-file://{up.file_id}"}}]}]
            assert c.chat(chat, max_tokens=4).token_ids == c.chat(by_url, max_tokens=4).token_ids
        assert stub.DeleteUpload(serve_pb2.UploadRef(file_id=up.file_id), timeout=30).deleted
        with pytest.raises(grpc.RpcError) as e:
            stub.GetUpload(serve_pb2.UploadRef(file_id=up.file_id), timeout=10)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND

"""rpc/choice_streams.py: one stream of n choices read as n streams, by each message's index."""
import asyncio

import pytest

from epdserve.rpc import serve_pb2
from epdserve.rpc.choice_streams import choice_streams


def _source(messages, fail: Exception | None = None, closed: list | None = None):
    async def gen():
        try:
            for m in messages:
                await asyncio.sleep(0)
                yield m
            if fail is not None:
                raise fail
        finally:
            if closed is not None:
                closed.append(True)
    return gen()


def _msg(index: int, tokens: list[int], finished: bool = False) -> serve_pb2.GenerateDelta:
    return serve_pb2.GenerateDelta(request_id="r", index=index, token_ids=tokens, finished=finished)


async def _read(stream) -> list[int]:
    return [t async for m in stream for t in m.token_ids]


def test_each_choice_reads_its_own_messages_in_order():
    msgs = [_msg(0, [1]), _msg(2, [7]), _msg(1, [4]), _msg(0, [2], True), _msg(2, [8]), _msg(1, [5], True),
            _msg(2, [9], True)]

    async def main():
        return await asyncio.gather(*(_read(s) for s in choice_streams(_source(msgs), 3)))

    assert asyncio.run(main()) == [[1, 2], [4, 5], [7, 8, 9]]


def test_one_choice_is_the_stream_itself():
    src = _source([_msg(0, [1], True)])
    assert choice_streams(src, 1) == [src]
    with pytest.raises(ValueError):
        choice_streams(src, 0)


def test_a_failure_is_every_choice_s_and_closing_one_closes_the_source():
    async def main():
        closed: list = []
        streams = choice_streams(_source([_msg(0, [1]), _msg(1, [2])], RuntimeError("gone"), closed), 2)
        got = await asyncio.gather(*(_read(s) for s in streams), return_exceptions=True)
        assert [str(e) for e in got] == ["gone", "gone"]
        closed2: list = []
        streams = choice_streams(_source([_msg(0, [1]), _msg(1, [2])], closed=closed2), 2)
        assert (await streams[1].__anext__()).token_ids == [2]
        await streams[0].aclose()
        return closed2

    assert asyncio.run(main()) == [True]

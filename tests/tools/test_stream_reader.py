"""What the load client and the benchmarks read from a streamed answer (`gateway.tools.stream`)."""

from __future__ import annotations

import orjson

from gateway.tools.stream import StreamReader


def chat_event(content: str) -> bytes:
    delta = {"choices": [{"index": 0, "delta": {"content": content}}]}
    return b"data: " + orjson.dumps(delta) + b"\r\n\r\n"


CHAT_STREAM = (
    chat_event("")  # the role's event carries no content
    + b": keep-alive\r\n\r\n"
    + chat_event("Hel")
    + chat_event("lo")
    + b"data: [DONE]\r\n\r\n"
)


def read(stream: bytes, reader: StreamReader, step: int) -> StreamReader:
    """Feed `stream` `step` bytes at a time, each piece at the time of its end offset."""
    for at in range(0, len(stream), step):
        piece = stream[at : at + step]
        reader.feed(piece, float(at + len(piece)))
    return reader


def test_a_chat_stream_is_read_whatever_its_network_pieces() -> None:
    """Content events are counted, the first timed when the bytes that end it arrive, and `[DONE]`
    seen, with CRLF line ends cut anywhere, a comment between events, one byte at a time or all
    at once."""
    # The event's last CR ends it: the LF after it may come in a later piece.
    first_ends = CHAT_STREAM.index(chat_event("Hel")) + len(chat_event("Hel")) - 1
    for step in (1, 2, 7, len(CHAT_STREAM)):
        reader = read(CHAT_STREAM, StreamReader(), step)
        assert (reader.content, reader.done, reader.error) == (2, True, None), step
        assert reader.t_first == min(len(CHAT_STREAM), -(-first_ends // step) * step), step


def test_a_completions_stream_counts_its_text() -> None:
    reader = StreamReader()
    reader.feed(b'data: {"choices":[{"index":0,"text":"Hi"}]}\n\ndata: [DONE]\n\n', 1.0)
    assert (reader.content, reader.done, reader.t_first) == (1, True, 1.0)


def test_an_anthropic_stream_ends_with_message_stop() -> None:
    """Named events: text deltas are content, `message_stop` is the end marker."""
    stream = (
        b'event: message_start\ndata: {"type":"message_start","message":{"content":[]}}\n\n'
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"text_delta","text":"Hi"}}\n\n'
        b'event: ping\ndata: {"type":"ping"}\n\n'
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    )
    reader = read(stream, StreamReader(), 5)
    assert (reader.content, reader.done, reader.error) == (1, True, None)


def test_an_error_event_is_kept_with_its_code() -> None:
    reader = StreamReader()
    reader.feed(chat_event("Hi"), 1.0)
    reader.feed(b'data: {"error":{"message":"cut","code":"upstream_stream_error"}}\n\n', 2.0)
    assert reader.error is not None and reader.error.startswith("error event")
    assert (reader.error_code, reader.content, reader.done) == ("upstream_stream_error", 1, False)


def test_errors_only_after_first_still_sees_errors() -> None:
    """After the first content only events that may hold an error are decoded: the count stops
    at one, a later error is still seen."""
    reader = StreamReader(errors_only_after_first=True)
    reader.feed(chat_event("a") + chat_event("b") + chat_event("c"), 1.0)
    assert (reader.content, reader.t_first, reader.error) == (1, 1.0, None)
    reader.feed(b'data: {"error":{"message":"late"}}\n\ndata: [DONE]\n\n', 2.0)
    assert reader.error is not None and reader.done


def test_bytes_that_are_no_event_stream_are_an_error() -> None:
    """A bad event, JSON that is not an object, and bytes that are not UTF-8."""
    for stream, start in (
        (b"data: {not json\n\n", "bad event"),
        (b"data: [1]\n\n", "bad event"),
        (b"data: \xff\xfe\n\n", "bad stream"),
    ):
        reader = StreamReader()
        reader.feed(stream, 1.0)
        assert reader.error is not None and reader.error.startswith(start), stream
        assert not reader.content

"""The Responses API's conversation state, served from the gateway's own store: a request's
`previous_response_id` expanded into its input before routing (so the conversation may go to any
upstream), and `GET`/`DELETE /v1/responses/{id}` and its input items. A request naming a
`conversation` takes its items as the history instead (`gateway.api.conversations`), and its
turn is appended to it.

A response is visible only to the key that created it (its identity, not its name: a new key
under the same name is another owner); another key's id reads as not found.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import orjson
from starlette.responses import Response

from gateway.admission.auth import Principal
from gateway.admission.validate import off_loop
from gateway.api.conversations import (
    append_turn,
    as_item,
    conversation_id,
    history,
    is_conversation,
    parse,
    read,
)
from gateway.errors import InvalidRequestError, NotFoundError
from gateway.models import Call
from gateway.providers.translate.items import input_items, output_items_as_input
from gateway.responses.store import ResponseGoneError, ResponseStore, StoredResponse

_JSON = "application/json"


def owner_of(principal: Principal | None) -> str:
    """Whose responses a caller sees: its key's identity ("" when keys are off)."""
    if principal is None:
        return ""
    return principal.identity or principal.name


async def continue_conversation(store: ResponseStore, call: Call, owner: str) -> Call:
    """The call with its `previous_response_id` expanded: the stored conversation, the previous
    response's output, then this request's input, as one `input`."""
    return (await expand_conversation(store, call, owner))[0]


async def expand_conversation(store: ResponseStore, call: Call, owner: str) -> tuple[Call, int]:
    """`continue_conversation`, and the tokens of the conversation so far as its upstream
    billed them (the stored turn's input and output tokens; 0 when it did not say). Raises
    InvalidRequestError when the previous response is not found for `owner`, NotFoundError
    when the conversation is not."""
    named = conversation_id(call.body)
    if named is not None:
        found = await read(store, named, owner)
        size = len(found.items) + len(call.raw)
        return await off_loop(size, _continued, call, found)
    previous = call.body.get("previous_response_id")
    if not previous:
        return call, 0
    if is_conversation(previous):
        raise _previous_missing(previous, "")
    try:
        stored = await store.get(previous, owner)
    except ResponseGoneError as gone:
        raise _previous_missing(previous, f": {gone.reason}") from None
    if stored is None:
        raise _previous_missing(previous, "")
    # A stored conversation may be megabytes: its Python-level work runs off the loop then.
    size = len(stored.items) + len(stored.response) + len(call.raw)
    return await off_loop(size, _expanded, call, stored)


def _expanded(call: Call, stored: StoredResponse) -> tuple[Call, int]:
    history: list[Any] = orjson.loads(stored.items)
    response = orjson.loads(stored.response)
    history += output_items_as_input(response)
    history += input_items(call.body)
    body = {**call.body, "input": history}
    lineage = (stored.id, *stored.ancestors)
    return replace(call, body=body, raw=orjson.dumps(body), lineage=lineage), _billed(response)


def _continued(call: Call, stored: StoredResponse) -> tuple[Call, int]:
    earlier = history(parse(stored))
    body = {**call.body, "input": earlier + input_items(call.body)}
    raw = orjson.dumps(body)
    return replace(call, body=body, raw=raw, history_items=len(earlier)), 0


def _billed(response: Any) -> int:
    """The tokens a stored turn's upstream reported for its input and output (0: none)."""
    usage = response.get("usage") if isinstance(response, dict) else None
    if not isinstance(usage, dict):
        return 0
    total = 0
    for name in ("input_tokens", "output_tokens"):
        value = usage.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            total += value
    return total


def _previous_missing(previous: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"Previous response with id '{previous[:64]}' not found{why}.",
        param="previous_response_id",
        code="previous_response_not_found",
    )


def keep(store: ResponseStore, call: Call, response: dict[str, Any], owner: str) -> bool:
    """Store a finished response (unless the request said `store: false`) and append its turn to
    the conversation it named; False when either was to be done and was not (too large: a read
    of its id then says why)."""
    appended = True
    if conversation_id(call.body) is not None:
        appended = append_turn(store, call.body, call.history_items, response, owner)
    if call.body.get("store") is False:
        return appended
    return appended & store.put(
        StoredResponse(
            id=response["id"],
            owner=owner,
            response=orjson.dumps(response),
            items=orjson.dumps(input_items(call.body)),
            created_at=int(time.time()),  # its TTL runs from now, whatever the upstream's clock
            ancestors=call.lineage,
        )
    )


def _missing(response_id: str, why: str = "") -> NotFoundError:
    return NotFoundError(
        f"No response with id '{response_id[:64]}' was found{why}.", code="response_not_found"
    )


async def _read(store: ResponseStore, response_id: str, owner: str) -> StoredResponse | None:
    if is_conversation(response_id):
        return None  # a conversation shares the store, not the endpoints
    try:
        return await store.get(response_id, owner)
    except ResponseGoneError as gone:
        raise _missing(response_id, f": {gone.reason}") from None


async def get_response(store: ResponseStore, response_id: str, owner: str) -> Response:
    stored = await _read(store, response_id, owner)
    if stored is None:
        raise _missing(response_id)
    return Response(stored.response, media_type=_JSON)


async def delete_response(store: ResponseStore, response_id: str, owner: str) -> Response:
    if is_conversation(response_id) or not await store.delete(response_id, owner):
        raise _missing(response_id)
    body = {"id": response_id, "object": "response.deleted", "deleted": True}
    return Response(orjson.dumps(body), media_type=_JSON)


async def list_input_items(
    store: ResponseStore, response_id: str, owner: str, *, limit: int, order: str
) -> Response:
    """The input items a stored response was made from (the whole conversation before it)."""
    stored = await _read(store, response_id, owner)
    if stored is None:
        raise _missing(response_id)
    items = [as_item(item) for item in orjson.loads(stored.items)]
    if order == "desc":
        items.reverse()
    page = items[:limit]
    body = {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > len(page),
    }
    return Response(orjson.dumps(body), media_type=_JSON)

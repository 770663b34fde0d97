"""The Conversations API's routes (`/v1/conversations`, its items), as OpenAI serves them: a
conversation and its items are the calling key's only (another key's id is not found), errors
are in the OpenAI shape. What is kept, and how, is `gateway.api.conversations`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi import FastAPI, Request
from starlette.responses import Response

from gateway.admission.validate import load_body, missing_param, off_loop
from gateway.api.admit import ClientGoneError, read_body
from gateway.api.conversation import owner_of
from gateway.api.conversations import (
    Conversation,
    check_items,
    check_metadata,
    latest,
    load,
    missing,
    new_conversation,
    page,
    save,
)
from gateway.api.edge import context_of
from gateway.api.render import error_response
from gateway.errors import GatewayError, InvalidRequestError, NotFoundError
from gateway.responses.store import ResponseStore
from gateway.runtime import Runtime

_JSON = "application/json"
_NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: {"description": "No conversation with that id for this key (`conversation_not_found`)."}
}


class _Caller:
    """A conversation request's store, owner and body."""

    def __init__(self, request: Request) -> None:
        runtime: Runtime = request.scope["state"]["runtime"]
        self.request = request
        self.runtime = runtime
        self.store: ResponseStore = runtime.services.responses
        self.owner = owner_of(context_of(request.scope).principal)

    async def body(self) -> dict[str, Any]:
        server = self.runtime.services.settings.server
        scope, receive = self.request.scope, self.request.receive
        raw = await read_body(scope, receive, server.max_body_bytes, server.read_timeout_s)
        body = await off_loop(len(raw), load_body, raw) if raw.strip() else {}
        if not isinstance(body, dict):
            raise InvalidRequestError("The request body must be a JSON object.")
        return body

    async def changed(self, conversation_id: str, change: Callable[[Conversation], Any]) -> Any:
        """Apply `change` to the conversation and write it back. Read first (from Redis if need
        be), then changed on what memory holds, with no await between that and the write."""
        await load(self.store, conversation_id, self.owner)
        conversation = latest(self.store, conversation_id, self.owner)
        if conversation is None:  # deleted meanwhile
            raise missing(conversation_id)
        result = change(conversation)
        save(self.store, conversation)
        return result


def _json(body: Any) -> Response:
    return Response(orjson.dumps(body), media_type=_JSON)


async def _served(request: Request, action: Callable[[_Caller], Awaitable[Any]]) -> Response:
    """Run a route's action; a GatewayError becomes its OpenAI error. Parameters are read from
    the request, as the stored-response routes read them (see gateway/api/app.py)."""
    try:
        return _json(await action(_Caller(request)))
    except GatewayError as error:
        return error_response(error, "openai")
    except ClientGoneError:
        return Response(status_code=499)


def add_conversation_routes(app: FastAPI) -> None:
    """The eight routes of the Conversations API."""

    @app.post("/v1/conversations")
    async def create_conversation(request: Request) -> Response:
        async def create(caller: _Caller) -> Any:
            body = await caller.body()
            metadata = check_metadata(body.get("metadata"))
            items = check_items(body.get("items") or [])
            conversation = new_conversation(caller.owner, metadata)
            conversation.add(items)
            save(caller.store, conversation)
            return conversation.as_object()

        return await _served(request, create)

    @app.get("/v1/conversations/{conversation_id}", responses=_NOT_FOUND)
    async def retrieve_conversation(request: Request) -> Response:
        async def retrieve(caller: _Caller) -> Any:
            name = request.path_params["conversation_id"]
            return (await load(caller.store, name, caller.owner)).as_object()

        return await _served(request, retrieve)

    @app.post("/v1/conversations/{conversation_id}", responses=_NOT_FOUND)
    async def update_conversation(request: Request) -> Response:
        async def update(caller: _Caller) -> Any:
            body = await caller.body()
            if "metadata" not in body:
                raise missing_param("metadata")
            metadata = check_metadata(body["metadata"])

            def retag(conversation: Conversation) -> Any:
                conversation.metadata = metadata
                return conversation.as_object()

            return await caller.changed(request.path_params["conversation_id"], retag)

        return await _served(request, update)

    @app.delete("/v1/conversations/{conversation_id}", responses=_NOT_FOUND)
    async def delete_conversation(request: Request) -> Response:
        async def delete(caller: _Caller) -> Any:
            name = request.path_params["conversation_id"]
            await load(caller.store, name, caller.owner)
            if not await caller.store.delete(name, caller.owner):
                raise missing(name)
            return {"id": name, "object": "conversation.deleted", "deleted": True}

        return await _served(request, delete)

    @app.post("/v1/conversations/{conversation_id}/items", responses=_NOT_FOUND)
    async def create_items(request: Request) -> Response:
        async def create(caller: _Caller) -> Any:
            body = await caller.body()
            if "items" not in body:
                raise missing_param("items")
            items = check_items(body["items"])
            added = await caller.changed(
                request.path_params["conversation_id"], lambda c: c.add(items)
            )
            return page(added, after=None, limit=len(added) or 1, order="asc")

        return await _served(request, create)

    @app.get("/v1/conversations/{conversation_id}/items", responses=_NOT_FOUND)
    async def list_items(request: Request) -> Response:
        async def listed(caller: _Caller) -> Any:
            query = request.query_params
            limit, order = query.get("limit", "20"), query.get("order", "desc")
            if not limit.isdigit() or not 1 <= int(limit) <= 100:
                raise InvalidRequestError(
                    "Invalid 'limit': expected an integer from 1 to 100.", param="limit"
                )
            if order not in ("asc", "desc"):
                raise InvalidRequestError(
                    "Invalid 'order': expected 'asc' or 'desc'.", param="order"
                )
            # `include` asks for fields an upstream adds to its items: these have them already.
            name = request.path_params["conversation_id"]
            conversation = await load(caller.store, name, caller.owner)
            after = query.get("after") or None
            return page(conversation.items, after=after, limit=int(limit), order=order)

        return await _served(request, listed)

    @app.get("/v1/conversations/{conversation_id}/items/{item_id}", responses=_NOT_FOUND)
    async def retrieve_item(request: Request) -> Response:
        async def retrieve(caller: _Caller) -> Any:
            name, item_id = request.path_params["conversation_id"], request.path_params["item_id"]
            item = (await load(caller.store, name, caller.owner)).item(item_id)
            if item is None:
                raise _item_missing(item_id)
            return item

        return await _served(request, retrieve)

    @app.delete("/v1/conversations/{conversation_id}/items/{item_id}", responses=_NOT_FOUND)
    async def delete_item(request: Request) -> Response:
        async def delete(caller: _Caller) -> Any:
            item_id = request.path_params["item_id"]

            def drop(conversation: Conversation) -> Any:
                item = conversation.item(item_id)
                if item is None:
                    raise _item_missing(item_id)
                conversation.items.remove(item)
                return conversation.as_object()

            return await caller.changed(request.path_params["conversation_id"], drop)

        return await _served(request, delete)


def _item_missing(item_id: str) -> NotFoundError:
    return NotFoundError(f"Item with id '{item_id[:64]}' not found.", code="item_not_found")

"""The Conversations API's conversations, kept in the stored responses' store: one entry per
conversation (`conv_...`), its object in the entry's `response` and its items, oldest first, in
`items`. So a conversation has the stored responses' owner scoping (another key's conversation
is not found), bounds (`max_bytes_per_response` for the whole conversation, the memory tier's
entries and bytes) and Redis tier; its TTL runs from its last change.

A change is a read-modify-write of the whole entry. Within a process it starts from what memory
holds (`ResponseStore.latest`), with no await before the write, so concurrent appends to one
conversation do not lose each other; across replicas the last write wins.

`POST /v1/responses` with `conversation` takes the conversation's items as the request's history
(`expand`) and appends the request's input and the response's output to it (`append_turn`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Final

import orjson

from gateway.errors import InvalidRequestError, NotFoundError
from gateway.providers.translate.items import input_items, new_id
from gateway.responses.ids import new_conversation_id
from gateway.responses.store import ResponseGoneError, ResponseStore, StoredResponse

PREFIX: Final = "conv_"
MAX_ADDED: Final = 20  # items per `POST .../items` (and per create), as OpenAI takes them
MAX_METADATA: Final = 16  # metadata pairs, keys of up to 64 characters, values of 512
_ROLES: Final = frozenset({"user", "assistant", "system", "developer"})
_ID_PREFIXES: Final = {
    "message": "msg_",
    "function_call": "fc_",
    "reasoning": "rs_",
    "custom_tool_call": "ctc_",
}


@dataclass(slots=True)
class Conversation:
    """One conversation as stored: its object's fields and its items, oldest first."""

    id: str
    owner: str
    created_at: int
    metadata: dict[str, str] = field(default_factory=dict)
    items: list[dict[str, Any]] = field(default_factory=list)

    def as_object(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "conversation",
            "created_at": self.created_at,
            "metadata": self.metadata,
        }

    def item(self, item_id: str) -> dict[str, Any] | None:
        return next((item for item in self.items if item.get("id") == item_id), None)

    def add(self, items: list[Any]) -> list[dict[str, Any]]:
        """Append items as the API lists them (each with an id unique in the conversation)."""
        taken = {item.get("id") for item in self.items}
        added = []
        for raw in items:
            item = as_item(raw)
            if item["id"] in taken or not isinstance(item["id"], str):
                item["id"] = new_id(_ID_PREFIXES.get(item["type"], "item_"))
            taken.add(item["id"])
            added.append(item)
        self.items += added
        return added


def is_conversation(entry_id: str) -> bool:
    return entry_id.startswith(PREFIX)


def new_conversation(owner: str, metadata: dict[str, str]) -> Conversation:
    now = int(time.time())
    return Conversation(new_conversation_id(now=now), owner, now, metadata)


def _from_stored(stored: StoredResponse) -> Conversation:
    head = orjson.loads(stored.response)
    items = orjson.loads(stored.items)
    return Conversation(stored.id, stored.owner, head["created_at"], head["metadata"], items)


def missing(conversation_id: str) -> NotFoundError:
    return NotFoundError(
        f"Conversation with id '{conversation_id[:64]}' not found.", code="conversation_not_found"
    )


async def load(store: ResponseStore, conversation_id: str, owner: str) -> Conversation:
    """The owner's conversation. Raises NotFoundError (unknown, expired, deleted, another
    owner's) and StoreUnavailableError (as a stored response's read does)."""
    return _from_stored(await read(store, conversation_id, owner))


def parse(stored: StoredResponse) -> Conversation:
    return _from_stored(stored)


async def read(store: ResponseStore, conversation_id: str, owner: str) -> StoredResponse:
    """The owner's conversation as stored (`load` parses it); raises as `load` does."""
    if not is_conversation(conversation_id):
        raise missing(conversation_id)
    try:
        stored = await store.get(conversation_id, owner, fresh=True)
    except ResponseGoneError:
        stored = None
    if stored is None:
        raise missing(conversation_id)
    return stored


def latest(store: ResponseStore, conversation_id: str, owner: str) -> Conversation | None:
    """The conversation as memory holds it, to change and `save` with no await between."""
    stored = store.latest(conversation_id, owner)
    return _from_stored(stored) if stored is not None else None


def save(store: ResponseStore, conversation: Conversation) -> None:
    """Write the whole conversation (never waits). Raises InvalidRequestError when it would be
    larger than `responses.max_bytes_per_response` (it is then left as it was), or when
    conversations are not kept (`responses.store: off`)."""
    head = orjson.dumps(conversation.as_object())
    items = orjson.dumps(conversation.items)
    limit = store.spec.max_bytes_per_response
    if len(head) + len(items) > limit:
        raise InvalidRequestError(
            f"The conversation would take {len(head) + len(items)} bytes, over "
            f"responses.max_bytes_per_response ({limit} bytes); it was not changed.",
            code="conversation_too_large",
        )
    stored = StoredResponse(
        conversation.id, conversation.owner, head, items, int(time.time())
    )  # its TTL runs from this change
    if not store.put(stored):
        raise InvalidRequestError(
            "The gateway keeps no conversations (responses.store is off).",
            code="conversations_disabled",
        )


def check_items(items: object, param: str = "items") -> list[dict[str, Any]]:
    """Items a client adds: at most MAX_ADDED objects, each a message (with a role the API
    takes, text or content parts) or an item with a type. Raises InvalidRequestError."""
    if not isinstance(items, list):
        raise InvalidRequestError(f"Invalid '{param}': expected an array.", param=param)
    if len(items) > MAX_ADDED:
        raise InvalidRequestError(
            f"Invalid '{param}': at most {MAX_ADDED} items may be added at once, got {len(items)}.",
            param=param,
            code="array_above_max_length",
        )
    for index, item in enumerate(items):
        where = f"{param}[{index}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(f"Invalid '{where}': expected an object.", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if not isinstance(kind, str):
            raise InvalidRequestError(f"Missing or invalid '{where}.type'.", param=f"{where}.type")
        if kind == "item_reference":
            raise InvalidRequestError(
                f"Invalid '{where}': an item_reference cannot be added; add the item itself.",
                param=where,
            )
        if kind == "message":
            if item.get("role") not in _ROLES:
                raise InvalidRequestError(
                    f"Invalid '{where}.role': expected one of {', '.join(sorted(_ROLES))}.",
                    param=f"{where}.role",
                )
            if not isinstance(item.get("content"), str | list):
                raise InvalidRequestError(
                    f"Invalid '{where}.content': expected a string or an array.",
                    param=f"{where}.content",
                )
    return items


def check_metadata(metadata: object) -> dict[str, str]:
    """At most MAX_METADATA string pairs (keys up to 64 characters, values up to 512)."""
    if metadata is None:
        return {}
    ok = (
        isinstance(metadata, dict)
        and len(metadata) <= MAX_METADATA
        and all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
            for k, v in metadata.items()
        )
    )
    if not ok:
        raise InvalidRequestError(
            f"Invalid 'metadata': expected an object of at most {MAX_METADATA} string values "
            "(keys of up to 64 characters, values of up to 512).",
            param="metadata",
        )
    assert isinstance(metadata, dict)
    return metadata


# --- as the history of a Responses request ------------------------------------------------------


def conversation_id(body: dict[str, Any]) -> str | None:
    """The `conversation` a Responses request names (an id, or an object with one)."""
    value = body.get("conversation")
    if isinstance(value, dict):
        value = value.get("id")
    return value if isinstance(value, str) else None


def history(conversation: Conversation) -> list[dict[str, Any]]:
    """The conversation's items as input items of the next turn. Reasoning items are left out,
    as `previous_response_id` leaves them out: a translated upstream cannot take them back, and
    a native one, asked to store nothing, cannot resolve them without their encrypted content."""
    out: list[dict[str, Any]] = []
    for item in conversation.items:
        kind = item.get("type")
        if kind == "reasoning":
            continue
        if kind == "message":
            out.append({"type": "message", "role": item["role"], "content": item["content"]})
        else:
            out.append({k: v for k, v in item.items() if k != "status"})
    return out


def append_turn(
    store: ResponseStore, body: dict[str, Any], known: int, response: dict[str, Any], owner: str
) -> bool:
    """Append a finished turn to the conversation its request named: the request's own input
    (what follows the `known` items of history it was given) and the response's output. False
    when it was not appended: the conversation is gone (deleted meanwhile, or pushed out of
    memory), or it would grow over `max_bytes_per_response`."""
    name = conversation_id(body)
    conversation = latest(store, name, owner) if name is not None else None
    if conversation is None:
        return False
    added = input_items(body)[known:]
    added += [item for item in response.get("output") or () if isinstance(item, dict)]
    conversation.add(added)
    try:
        save(store, conversation)
    except InvalidRequestError:
        return False
    return True


# --- items as the API lists them --------------------------------------------------------------


def as_item(item: Any) -> dict[str, Any]:
    """An item as the API lists it: with an id, a message's content as parts."""
    if not isinstance(item, dict):
        return {"id": new_id("item_"), "type": "unknown"}
    out = dict(item)
    kind = out.setdefault("type", "message")
    if kind == "message":
        out.setdefault("id", new_id("msg_"))
        out.setdefault("status", "completed")
        content = out.get("content")
        if isinstance(content, str):
            content = [
                {
                    "type": "output_text" if out.get("role") == "assistant" else "input_text",
                    "text": content,
                }
            ]
        if isinstance(content, list):
            out["content"] = [_as_part(part) for part in content]
    else:
        out.setdefault("id", new_id(_ID_PREFIXES.get(kind, "item_")))
    return out


def _as_part(part: Any) -> Any:
    """A content part with the fields the API lists it with (that a request may leave out)."""
    if not isinstance(part, dict):
        return part
    kind = part.get("type")
    if kind == "output_text" and "annotations" not in part:
        return {**part, "annotations": []}
    if kind == "input_image" and part.get("detail") is None:
        return {**part, "detail": "auto"}
    return part


def page(
    items: list[dict[str, Any]], *, after: str | None, limit: int, order: str
) -> dict[str, Any]:
    """One page of a list of items (`after`: the id the page starts after, in `order`)."""
    ordered = items[::-1] if order == "desc" else items
    if after is not None:
        at = next((i for i, item in enumerate(ordered) if item.get("id") == after), None)
        if at is None:
            raise InvalidRequestError(
                f"Invalid 'after': no item with id '{after[:64]}' in this list.", param="after"
            )
        ordered = ordered[at + 1 :]
    chosen = ordered[:limit]
    return {
        "object": "list",
        "data": chosen,
        "first_id": chosen[0]["id"] if chosen else None,
        "last_id": chosen[-1]["id"] if chosen else None,
        "has_more": len(ordered) > len(chosen),
    }

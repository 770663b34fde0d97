"""Request translation from the OpenAI chat wire to Gemini's `generateContent`, as dicts. Pure.

Gemini models (on the Gemini API and on Vertex AI) present the chat wire to the rest of the
gateway: the provider translates each chat request here and each answer back in
`gemini_answers`. What maps:

- `system`/`developer` messages → `systemInstruction` (their texts in order); `user` → a `user`
  turn, `assistant` → a `model` turn, consecutive `tool` messages → one `user` turn of
  `functionResponse` parts (name found from the assistant's call, JSON-object results as they
  are, anything else as `{"result": text}`); turns of the same role are merged.
- text parts → `text`; `image_url`/`input_audio`/`file` data → `inlineData`; an image URL that is
  not a data URL → `fileData` (`fileUri`).
- `tools` → one `functionDeclarations` tool (`parametersJsonSchema`: the JSON Schema as sent);
  `tool_choice` → `toolConfig.functionCallingConfig` (auto/none/required → AUTO/NONE/ANY, a
  named function → ANY with `allowedFunctionNames`); assistant `tool_calls` → `functionCall`
  parts. A call id this gateway minted from a Gemini call carries that call's own id and
  thought signature back (see `call_id`).
- `max_completion_tokens`/`max_tokens`, `temperature`, `top_p`, `stop`, `n`, `seed`,
  `presence_penalty`, `frequency_penalty` → `generationConfig`; `response_format` json_object /
  json_schema → `responseMimeType: application/json` (+ `responseJsonSchema`);
  `reasoning_effort` → `thinkingConfig` (a `thinkingLevel` for Gemini 3 models, else a
  `thinkingBudget`; thoughts are asked for, and come back as `reasoning_content`).

Dropped: `logprobs`/`top_logprobs`, `logit_bias`, `user`, `metadata`, `store`,
`parallel_tool_calls`, `service_tier`, `prediction`, `modalities`/`audio`, `safety_identifier`,
`prompt_cache_key`, `stream_options` (usage always comes), an assistant's `reasoning_content`
(Gemini takes thoughts back only as signatures) and `refusal`, a tool's `strict`.
"""

from __future__ import annotations

import base64
import binascii
import mimetypes
from typing import Any, Final

import orjson

from gateway.providers.translate.shapes import TranslationError, _dict, _list, _parse_data_url

# reasoning_effort → Gemini 2.5's thinkingBudget (Google's own OpenAI-compatible mapping).
_BUDGETS: Final[dict[str, int]] = {"none": 0, "minimal": 1024, "low": 1024, "medium": 8192}
_HIGH_BUDGET: Final = 24576
_PRO_MIN_BUDGET: Final = 128
# ... and Gemini 3's thinkingLevel (Pro knows low and high).
_LEVELS: Final[dict[str, str]] = {"none": "low", "minimal": "low", "low": "low"}
_TOOL_CHOICE: Final[dict[str, str]] = {"auto": "AUTO", "none": "NONE", "required": "ANY"}
# Gemini 3 refuses a function call of the current turn without its signature; Google documents
# this value for calls whose signature is not known (made elsewhere, or by another model).
SKIP_SIGNATURE: Final = "skip_thought_signature_validator"
_CALL_PREFIX: Final = "gc_"


def call_id(gemini_id: str | None, signature: str | None, fallback: str) -> str:
    """The chat tool-call id of a Gemini `functionCall`: its own id and thought signature packed
    in (base64url of a small JSON), so the next turn can send both back; `fallback` when it
    has neither."""
    if not gemini_id and not signature:
        return fallback
    packed = orjson.dumps({"i": gemini_id, "s": signature})
    return _CALL_PREFIX + base64.urlsafe_b64encode(packed).rstrip(b"=").decode()


def unpack_call_id(value: str) -> tuple[str | None, str | None]:
    """A Gemini call's (id, thought signature) from a chat tool-call id `call_id` made."""
    if not value.startswith(_CALL_PREFIX):
        return None, None
    data = value[len(_CALL_PREFIX) :]
    try:
        packed = orjson.loads(base64.urlsafe_b64decode(data + "=" * (-len(data) % 4)))
    except (binascii.Error, ValueError):
        return None, None
    if not isinstance(packed, dict):
        return None, None
    gemini_id, signature = packed.get("i"), packed.get("s")
    return (
        gemini_id if isinstance(gemini_id, str) else None,
        signature if isinstance(signature, str) else None,
    )


def chat_request_to_gemini(body: dict[str, Any], model: str) -> dict[str, Any]:
    """An OpenAI chat completions body → a Gemini `GenerateContentRequest` (model goes in the
    URL). Raises TranslationError for what Gemini cannot take."""
    system: list[dict[str, Any]] = []
    contents: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # tool_call id → function name, for the function responses
    for i, message in enumerate(_list(body.get("messages"), "messages")):
        where = f"messages[{i}]"
        message = _dict(message, where)
        role = message.get("role")
        content = message.get("content")
        if role in ("system", "developer"):
            system.extend(_parts(content, where, text_only=True))
        elif role == "user":
            _append(contents, "user", _parts(content, where))
        elif role == "assistant":
            parts = _parts(content, where, text_only=True) if content else []
            parts.extend(_calls(message.get("tool_calls"), names, where))
            if parts:
                _append(contents, "model", parts)
        elif role == "tool":
            _append(contents, "user", [_function_response(message, names, where)])
        else:
            raise TranslationError(f"'{where}.role' {role!r} cannot be sent to Gemini", param=where)
    if not contents:
        raise TranslationError("Gemini needs at least one user message", param="messages")
    out: dict[str, Any] = {"contents": contents}
    if system:
        out["systemInstruction"] = {"parts": system}
    tools = body.get("tools")
    if tools:
        out["tools"] = [{"functionDeclarations": _declarations(tools)}]
    choice = body.get("tool_choice")
    if choice is not None and tools:
        out["toolConfig"] = {"functionCallingConfig": _tool_choice(choice)}
    config = _generation_config(body, model)
    if config:
        out["generationConfig"] = config
    return out


def _append(contents: list[dict[str, Any]], role: str, parts: list[dict[str, Any]]) -> None:
    """Gemini wants turns to alternate: parts of the same role as the last turn join it."""
    if contents and contents[-1]["role"] == role:
        contents[-1]["parts"].extend(parts)
    else:
        contents.append({"role": role, "parts": parts})


def _parts(content: object, where: str, *, text_only: bool = False) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"text": content}]
    if content is None:
        return [{"text": ""}]
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(_list(content, f"{where}.content")):
        at = f"{where}.content[{j}]"
        part = _dict(part, at)
        kind = part.get("type")
        if kind == "text":
            parts.append({"text": str(part.get("text") or "")})
        elif kind == "refusal":
            continue  # an assistant's refusal is not something Gemini takes back
        elif text_only:
            raise TranslationError(f"'{at}': only text can be sent here to Gemini", param=at)
        elif kind == "image_url":
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            if not isinstance(url, str) or not url:
                raise TranslationError(f"'{at}.image_url.url' must be a URL", param=at)
            parts.append(_media(url, at))
        elif kind == "input_audio":
            audio = _dict(part.get("input_audio"), f"{at}.input_audio")
            fmt = str(audio.get("format") or "wav")
            parts.append({"inlineData": {"mimeType": f"audio/{fmt}", "data": audio.get("data")}})
        elif kind == "file":
            data = _dict(part.get("file"), f"{at}.file").get("file_data")
            if not isinstance(data, str) or not data.startswith("data:"):
                raise TranslationError(f"'{at}.file' must carry file_data as a data URL", param=at)
            parts.append(_media(data, at))
        else:
            raise TranslationError(f"'{at}.type' {kind!r} cannot be sent to Gemini", param=at)
    return parts


def _media(url: str, at: str) -> dict[str, Any]:
    if url.startswith("data:"):
        mime, data = _parse_data_url(url, at)
        return {"inlineData": {"mimeType": mime, "data": data}}
    mime = mimetypes.guess_type(url.split("?", 1)[0])[0] or "image/jpeg"
    return {"fileData": {"mimeType": mime, "fileUri": url}}


def _calls(calls: object, names: dict[str, str], where: str) -> list[dict[str, Any]]:
    if not calls:
        return []
    parts: list[dict[str, Any]] = []
    for k, call in enumerate(_list(calls, f"{where}.tool_calls")):
        at = f"{where}.tool_calls[{k}]"
        call = _dict(call, at)
        function = _dict(call.get("function"), f"{at}.function")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise TranslationError(f"'{at}.function.name' must be a string", param=at)
        arguments = function.get("arguments") or "{}"
        try:
            args = orjson.loads(arguments) if isinstance(arguments, str) else arguments
        except orjson.JSONDecodeError:
            raise TranslationError(f"'{at}.function.arguments' is not JSON", param=at) from None
        if not isinstance(args, dict):
            raise TranslationError(f"'{at}.function.arguments' must be a JSON object", param=at)
        chat_id = str(call.get("id") or "")
        names[chat_id] = name
        gemini_id, signature = unpack_call_id(chat_id)
        function_call: dict[str, Any] = {"name": name, "args": args}
        if gemini_id:
            function_call["id"] = gemini_id
        part: dict[str, Any] = {"functionCall": function_call}
        if signature:
            part["thoughtSignature"] = signature
        elif k == 0:  # only a turn's first call carries one
            part["thoughtSignature"] = SKIP_SIGNATURE
        parts.append(part)
    return parts


def _function_response(
    message: dict[str, Any], names: dict[str, str], where: str
) -> dict[str, Any]:
    chat_id = str(message.get("tool_call_id") or "")
    name = names.get(chat_id) or message.get("name")
    if not isinstance(name, str) or not name:
        raise TranslationError(
            f"'{where}.tool_call_id' names no earlier assistant tool call", param=where
        )
    content = message.get("content")
    text = (
        content
        if isinstance(content, str)
        else "".join(p.get("text", "") for p in _list(content or [], where) if isinstance(p, dict))
    )
    try:
        parsed = orjson.loads(text)
    except orjson.JSONDecodeError:
        parsed = None
    response = parsed if isinstance(parsed, dict) else {"result": text}
    function_response: dict[str, Any] = {"name": name, "response": response}
    gemini_id, _ = unpack_call_id(chat_id)
    if gemini_id:
        function_response["id"] = gemini_id
    return {"functionResponse": function_response}


def _declarations(tools: object) -> list[dict[str, Any]]:
    declarations = []
    for i, tool in enumerate(_list(tools, "tools")):
        tool = _dict(tool, f"tools[{i}]")
        if tool.get("type") != "function":
            raise TranslationError(
                f"'tools[{i}].type' {tool.get('type')!r} cannot be sent to Gemini",
                param=f"tools[{i}].type",
            )
        function = _dict(tool.get("function"), f"tools[{i}].function")
        declaration: dict[str, Any] = {"name": function.get("name")}
        if function.get("description"):
            declaration["description"] = function["description"]
        if function.get("parameters"):
            declaration["parametersJsonSchema"] = function["parameters"]
        declarations.append(declaration)
    return declarations


def _tool_choice(choice: object) -> dict[str, Any]:
    if isinstance(choice, str) and choice in _TOOL_CHOICE:
        return {"mode": _TOOL_CHOICE[choice]}
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if isinstance(name, str) and name:
            return {"mode": "ANY", "allowedFunctionNames": [name]}
    raise TranslationError(
        f"'tool_choice' {choice!r} cannot be sent to Gemini", param="tool_choice"
    )


def _generation_config(body: dict[str, Any], model: str) -> dict[str, Any]:
    config: dict[str, Any] = {}
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    if limit is not None:
        config["maxOutputTokens"] = limit
    for chat, gemini in (
        ("temperature", "temperature"),
        ("top_p", "topP"),
        ("seed", "seed"),
        ("presence_penalty", "presencePenalty"),
        ("frequency_penalty", "frequencyPenalty"),
    ):
        if body.get(chat) is not None:
            config[gemini] = body[chat]
    stop = body.get("stop")
    if stop:
        config["stopSequences"] = [stop] if isinstance(stop, str) else stop
    n = body.get("n")
    if n is not None and n != 1:
        config["candidateCount"] = n
    response_format = body.get("response_format")
    if isinstance(response_format, dict):
        kind = response_format.get("type")
        if kind in ("json_object", "json_schema"):
            config["responseMimeType"] = "application/json"
        schema = (response_format.get("json_schema") or {}).get("schema")
        if kind == "json_schema" and schema:
            config["responseJsonSchema"] = schema
    effort = body.get("reasoning_effort")
    if isinstance(effort, str) and effort:
        config["thinkingConfig"] = thinking_config(effort, model)
    return config


def thinking_config(effort: str, model: str) -> dict[str, Any]:
    """`reasoning_effort` → `thinkingConfig`: Gemini 3 models take a level, earlier ones a
    token budget; `none` turns thinking off where the model allows it (Pro models think at
    least 128 tokens)."""
    if "gemini-3" in model:
        return {"thinkingLevel": _LEVELS.get(effort, "high"), "includeThoughts": effort != "none"}
    budget = _BUDGETS.get(effort, _HIGH_BUDGET)
    if budget == 0 and "pro" in model:
        budget = _PRO_MIN_BUDGET  # Pro models cannot stop thinking: the least they take
    return {"thinkingBudget": budget, "includeThoughts": budget > 0}

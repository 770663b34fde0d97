"""Agent frameworks that speak the Responses API, against the default config's simulated models
over real HTTP: the OpenAI Agents SDK's default runner with a function tool, and LangChain's
`ChatOpenAI(use_responses_api=True)`."""

from __future__ import annotations

from collections.abc import AsyncIterator

import agents
import langchain_openai
import openai
import pytest
from pydantic import BaseModel

from gateway.config import PACKAGED_CONFIG, load_settings
from tests.conftest import Gateway, run_gateway

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def gateway() -> AsyncIterator[Gateway]:
    async with run_gateway(load_settings(PACKAGED_CONFIG)) as gw:
        yield gw


async def test_agents_sdk_runner_calls_a_function_tool(gateway: Gateway) -> None:
    """The runner's loop: the model calls the tool, the runner sends its output back with the
    conversation, and the model's text answer ends the run."""
    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"It is sunny in {city}."

    async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key="unused") as client:
        model = agents.OpenAIResponsesModel(model="chat-fast", openai_client=client)
        agent = agents.Agent(
            name="weather", instructions="Answer with the tool.", model=model, tools=[get_weather]
        )
        result = await agents.Runner.run(agent, "What is the weather in Paris?")
    assert len(calls) == 1 and isinstance(calls[0], str) and calls[0]
    assert isinstance(result.final_output, str) and result.final_output
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"]
    assert kinds[-1] == "message_output_item"


async def test_agents_sdk_streamed_run(gateway: Gateway) -> None:
    agents.set_tracing_disabled(True)
    async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key="unused") as client:
        model = agents.OpenAIResponsesModel(model="chat-fast", openai_client=client)
        agent = agents.Agent(name="plain", instructions="Be brief.", model=model)
        run = agents.Runner.run_streamed(agent, "Say hello.")
        deltas = [
            event.data.delta
            async for event in run.stream_events()
            if event.type == "raw_response_event"
            and event.data.type == "response.output_text.delta"
        ]
    assert deltas
    assert run.final_output == "".join(deltas)


async def test_langchain_chat_openai_on_the_responses_api(gateway: Gateway) -> None:
    chat = langchain_openai.ChatOpenAI(
        model="chat-fast", base_url=gateway.base_url, api_key="unused", use_responses_api=True
    )
    answer = await chat.ainvoke("Name three colours.")
    assert answer.text
    assert answer.response_metadata.get("id", "").startswith("resp_")
    assert answer.usage_metadata is not None and answer.usage_metadata["output_tokens"] > 0

    class Weather(BaseModel):
        city: str
        days: int

    with_tool = chat.bind_tools([Weather], tool_choice="Weather")
    called = await with_tool.ainvoke("Weather in Paris for three days?")
    (call,) = called.tool_calls
    assert call["name"] == "Weather"
    Weather.model_validate(call["args"])


async def test_responses_parse_json_schema(gateway: Gateway) -> None:
    """`responses.parse` sends a json_schema format; the simulator's output parses into it."""

    class Colours(BaseModel):
        colours: list[str]
        count: int

    async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key="unused") as client:
        parsed = await client.responses.parse(
            model="chat-fast", input="Name three colours.", text_format=Colours
        )
    assert isinstance(parsed.output_parsed, Colours)

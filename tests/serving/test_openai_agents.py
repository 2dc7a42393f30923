"""The official OpenAI Agents SDK (``openai-agents``) runs a two-tool agent loop against the real
stack, unchanged, over the Responses API (``OpenAIResponsesModel``, the SDK's default) and over chat
completions (``OpenAIChatCompletionsModel``), model = the SmolLM2 bundle.

What the server offers makes the tiny model's loop deterministic: greedy decoding (temperature 0),
and ``tool_choice="required"`` on the first turn, which the engine's grammar turns into a call that
is valid by construction; the SDK then resets the choice to ``auto`` (its default
``reset_tool_choice``) so the model may answer. What must hold is asserted, not what SmolLM2 says:
a tool was called with arguments that validate against its schema (the one the SDK sent), the run
ended with a final output string, and every model call went through this server."""
from __future__ import annotations

import asyncio

import pytest
from agents import Agent, ModelSettings, function_tool  # openai-agents: a dev dependency (pyproject.toml)

from tests.serving.openai_stack import MODEL

pytestmark = [pytest.mark.slow, pytest.mark.server]


def _agent(model, calls: list) -> Agent:
    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(("get_weather", {"city": city}))
        return f"It is sunny and 24 C in {city}."

    @function_tool
    def add(a: int, b: int) -> int:
        """The sum of two integers."""
        calls.append(("add", {"a": a, "b": b}))
        return a + b

    settings = ModelSettings(tool_choice="required", temperature=0.0, parallel_tool_calls=False)
    return Agent(name="Assistant", instructions="You are a helpful assistant. Use the tools to answer.",
                 tools=[get_weather, add], model=model, model_settings=settings)


@pytest.mark.parametrize("api,streamed", [("responses", False), ("responses", True), ("chat_completions", False),
                                          ("chat_completions", True)])
def test_an_agent_calls_a_tool_with_valid_arguments_and_answers(stack, api, streamed):
    """``streamed``: ``Runner.run_streamed``, which reads the server's events (Responses) or chunks."""
    import jsonschema
    from agents import (OpenAIChatCompletionsModel, OpenAIResponsesModel, RunConfig, Runner,
                        ToolCallItem, ToolCallOutputItem, set_tracing_disabled)
    from openai import AsyncOpenAI
    set_tracing_disabled(True)   # the SDK would otherwise send traces to OpenAI's servers

    async def run():
        client = AsyncOpenAI(base_url=stack.base, api_key="unused", max_retries=0, timeout=300)
        model = (OpenAIResponsesModel(model=MODEL, openai_client=client) if api == "responses"
                 else OpenAIChatCompletionsModel(model=MODEL, openai_client=client))
        calls: list = []
        agent = _agent(model, calls)
        ask, config = "What is the weather in Paris?", RunConfig(tracing_disabled=True)
        try:
            if streamed:
                result = Runner.run_streamed(agent, ask, max_turns=6, run_config=config)
                events = [ev async for ev in result.stream_events()]
                assert any(ev.type == "raw_response_event" for ev in events)
            else:
                result = await Runner.run(agent, ask, max_turns=6, run_config=config)
        finally:
            await client.close()
        return agent, calls, result

    agent, calls, result = asyncio.run(run())
    assert calls, "no tool was called"
    schemas = {t.name: t.params_json_schema for t in agent.tools}
    for name, args in calls:
        jsonschema.validate(args, schemas[name])
    kinds = [type(it) for it in result.new_items]
    assert ToolCallItem in kinds and ToolCallOutputItem in kinds
    assert kinds.index(ToolCallItem) < kinds.index(ToolCallOutputItem)
    assert isinstance(result.final_output, str) and result.final_output.strip(), result.final_output
    # every model turn was this server's: its ids (chat completions: the SDK's stand-in id)
    assert len(result.raw_responses) >= 2
    if api == "responses":
        assert all(r.response_id and r.response_id.startswith("resp_") for r in result.raw_responses)

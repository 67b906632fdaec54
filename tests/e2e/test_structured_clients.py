"""Structured output and tools as real clients use them, on SmolLM2: the openai SDK's
`chat.completions.parse` with a Pydantic model, LangChain's `with_structured_output`, and a LangChain
`bind_tools` agent loop that runs a Python tool and answers with its result."""
from __future__ import annotations

import langchain_openai
import pytest
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel, Field

from tests.e2e.servers import API_KEY


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)


class Capital(BaseModel):
    country: str = Field(max_length=30)
    capital: str = Field(max_length=30)


WEATHER_CALLS: list[str] = []


@tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    WEATHER_CALLS.append(city)
    return f"It is 23 degrees and sunny in {city}."


@pytest.fixture
def chat_model(server):
    return langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key=API_KEY, model="reame", temperature=0,
                                       max_tokens=60, max_retries=0, timeout=120)


def test_openai_sdk_parse_with_a_pydantic_model(client):
    r = client.chat.completions.parse(
        model="reame", messages=[{"role": "user", "content": "Ann is 31 years old. Give her as JSON."}],
        response_format=Person, max_tokens=48, temperature=0)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and r.choices[0].finish_reason == "stop"


def test_langchain_structured_output(chat_model):
    answer = chat_model.with_structured_output(Capital).invoke("What is the capital of France?")
    assert isinstance(answer, Capital)


def test_langchain_agent_loop_calls_a_python_tool_and_answers_with_its_result(chat_model):
    WEATHER_CALLS.clear()
    messages = [HumanMessage("What is the weather in Paris?")]
    caller = chat_model.bind_tools([get_weather], tool_choice="get_weather")
    reply = caller.invoke(messages)
    assert [call["name"] for call in reply.tool_calls] == ["get_weather"]
    messages.append(reply)
    for call in reply.tool_calls:
        messages.append(ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"]))
    assert len(WEATHER_CALLS) == 1
    answer = chat_model.invoke(messages)
    assert not answer.tool_calls and "23" in answer.content

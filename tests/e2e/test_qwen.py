"""Qwen2.5-Coder through the `openai` SDK against a real gateway and worker: fill-in-the-middle
(`suffix`, llama.cpp's /infill) and Qwen's own tool-call format on the 0.5B file; the forced call
and the answer after the tool's result on the 1.5B file (where the reported bug was). SmolLM2 has
no FIM tokens: a clear 400."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import requests

from tests.e2e.servers import API_KEY, auth, gateway_and_worker

PREFIX = 'def sum_of_squares(numbers):\n    """Return the sum of the squares of `numbers`."""\n'
SUFFIX = "\n    return total\n"
# The instruct model writes the given return line again after the body, and then goes on (an example,
# a closing ``` fence): editors cut at the suffix's first line, as this stop does.
STOP = ["\n    return"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def qwen05(qwen05_gguf, tmp_path_factory):
    with gateway_and_worker(tmp_path_factory.mktemp("qwen05"), qwen05_gguf) as server:
        yield server


def runs(middle: str) -> int:
    """The function the prefix, the middle and the suffix make, called on [1..5]."""
    scope: dict = {}
    exec(compile(PREFIX + middle + SUFFIX, "<infill>", "exec"), scope)  # noqa: S102 (the model's code, a test)
    return scope["sum_of_squares"]([1, 2, 3, 4, 5])


def test_suffix_fills_in_the_middle(qwen05):
    kw = {"model": "reame", "prompt": PREFIX, "suffix": SUFFIX, "temperature": 0, "max_tokens": 48, "stop": STOP}
    middle = sdk(qwen05).completions.create(**kw).choices[0].text
    assert "total" in middle and runs(middle) == 55
    streamed = "".join(c.choices[0].text for c in sdk(qwen05).completions.create(stream=True, **kw) if c.choices)
    assert streamed == middle


def test_llama_cpp_infill_route(qwen05):
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "temperature": 0, "n_predict": 48, "stop": STOP,
            "input_extra": [{"filename": "util.py", "text": "def square(x):\n    return x * x\n"}]}
    answer = requests.post(qwen05.url + "/infill", json=body, headers=auth(), timeout=300).json()
    assert answer["object"] == "text_completion" and answer["content"] == answer["choices"][0]["text"]
    assert runs(answer["content"]) == 55


def test_a_model_without_fim_tokens_refuses(server):
    with pytest.raises(openai.BadRequestError) as caught:
        sdk(server).completions.create(model="reame", prompt=PREFIX, suffix=SUFFIX, max_tokens=4)
    assert caught.value.body["param"] == "suffix" and "fill-in-the-middle" in caught.value.body["message"]
    r = requests.post(server.url + "/infill", json={"input_prefix": PREFIX}, headers=auth(), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_qwens_own_tool_call_is_parsed_streamed_and_not(qwen05):
    """Not forced: the model writes <tool_call>{...}</tool_call> itself, and it comes back as a call."""
    kw = {"model": "reame", "messages": ASK, "tools": [WEATHER], "temperature": 0, "max_tokens": 60}
    choice = sdk(qwen05).chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    parts, reasons = [], []
    for chunk in sdk(qwen05).chat.completions.create(stream=True, **kw):
        for streamed in chunk.choices:
            assert not streamed.delta.content
            parts += streamed.delta.tool_calls or []
            reasons += [streamed.finish_reason] if streamed.finish_reason else []
    assert reasons == ["tool_calls"] and parts[0].function.name == "get_weather"
    assert json.loads("".join(p.function.arguments or "" for p in parts)) == json.loads(call.function.arguments)


def test_forced_call_then_an_answer_in_text(qwen15_gguf, tmp_path):
    """The 1.5B file: a named tool_choice gives arguments valid for the schema; with the tool's
    result in the history (the call's arguments as the JSON string the SDK sends back), the next
    turn answers in text."""
    with gateway_and_worker(tmp_path, qwen15_gguf) as server:
        client = sdk(server)
        first = client.chat.completions.create(
            model="reame", messages=ASK, tools=[WEATHER], temperature=0, max_tokens=60,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0]
        [call] = first.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        history = ASK + [first.message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 23, "sky": "sunny"})}]
        answer = client.chat.completions.create(model="reame", messages=history, tools=[WEATHER], tool_choice="none",
                                                temperature=0, max_tokens=40).choices[0]
    assert answer.message.tool_calls is None and answer.finish_reason == "stop"
    assert "23" in answer.message.content and "{" not in answer.message.content

"""POST /v1/completions on the real model."""
from __future__ import annotations


def complete(client, **kw):
    return client.completions.create(model="reame", **kw)


def test_text_prompt(client):
    r = complete(client, prompt="The capital of France is", temperature=0, max_tokens=8)
    assert r.object == "text_completion" and "Paris" in r.choices[0].text
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"


def test_stream_equals_non_stream(client):
    plain = complete(client, prompt="Once upon a time", temperature=0, max_tokens=20).choices[0].text
    chunks = list(complete(client, prompt="Once upon a time", temperature=0, max_tokens=20, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain


def test_token_id_prompts_and_batches(client):
    by_text = complete(client, prompt="Hello", temperature=0, max_tokens=5)
    ids_r = complete(client, prompt=[19556], temperature=0, max_tokens=5)
    assert ids_r.usage.prompt_tokens == 1
    batch = complete(client, prompt=["Hello", "Goodbye"], temperature=0, max_tokens=5)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_text.choices[0].text


def test_logprobs_count(client):
    r = complete(client, prompt="1, 2, 3,", temperature=0, max_tokens=4, logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text
    assert len(lp.top_logprobs[0]) == 2 and lp.text_offset[0] == 0

"""[models] serve and repeated --model flags → the models one gateway serves, and what a request's
`model` field selects."""
from __future__ import annotations

import math

import pytest

from shared.config import parse_config
from shared.errors import ConfigError
from shared.model_registry import PINNED, default_keep_alive, memory_budget, repository_for

TWO = """[models]
serve =
    chat = ./models/qwen.gguf  aliases=assistant,coder  keep_alive=pinned
    small = smollm2-135m  context_length=2048  keep_alive=60
memory_budget = 2GiB
keep_alive = 30
"""


def test_serve_lines_name_models_with_their_options():
    config = parse_config(TWO, "/srv/reame/reame.conf")
    repo = repository_for(config)
    chat, small = repo.entries
    assert repo.served() == ["chat", "small"]
    assert chat.reference == "/srv/reame/models/qwen.gguf"  # relative to the config file
    assert small.reference == "smollm2-135m"  # a pullable name stays a name
    assert small.context_length == 2048 and chat.context_length == 0
    assert default_keep_alive(config, chat) == PINNED
    assert default_keep_alive(config, small) == 60
    assert memory_budget(config, 10**12) == 2 * 2**30


def test_a_request_selects_by_name_alias_or_file_and_defaults_to_the_first():
    repo = repository_for(parse_config(TWO, "/srv/reame/reame.conf"))
    assert repo.lookup(None).name == "chat"
    assert repo.lookup("").name == "chat"
    assert repo.lookup("coder").name == "chat"
    assert repo.lookup("qwen.gguf").name == "chat"
    assert repo.lookup("qwen").name == "chat"
    assert repo.lookup("small").name == "small"
    assert repo.lookup("gpt-4") is None


def test_without_serve_one_model_is_served_as_today():
    config = parse_config("[model]\nmodel_path = /m/smollm2.gguf\nmodel_id = reame\n")
    repo = repository_for(config)
    assert repo.served() == ["reame"]
    assert set(repo.default.names) == {"reame", "smollm2.gguf", "smollm2"}
    assert default_keep_alive(config, repo.default) == 300


def test_repeated_model_flags_serve_each_under_its_stem_or_name():
    config = parse_config(TWO, "/srv/reame/reame.conf")
    repo = repository_for(config, ["/m/smollm2-135m-q8.gguf", "gemma3-270m"])
    assert repo.served() == ["smollm2-135m-q8", "gemma3-270m"]
    # One --model keeps today's behaviour: that model under [model] model_id, [models] ignored.
    assert repository_for(config, ["/m/one.gguf"]).served() == ["reame"]


@pytest.mark.parametrize("line, message", [
    ("chat ./a.gguf", "expected 'NAME = PATH"),
    ("chat =", "expected 'NAME = PATH"),
    ("chat = ./a.gguf colour=red", "unknown option 'colour=red'"),
    ("chat = ./a.gguf context_length=lots", "context_length"),
    ("chat = ./a.gguf keep_alive=soon", "keep_alive"),
])
def test_a_bad_line_is_a_start_up_error_naming_it(line, message):
    config = parse_config(f"[models]\nserve =\n    {line}\n")
    with pytest.raises(ConfigError, match=message) as info:
        repository_for(config)
    assert "line 1" in str(info.value)


def test_one_name_for_two_models_is_refused():
    config = parse_config("[models]\nserve =\n    a = ./x.gguf aliases=b\n    b = ./y.gguf\n")
    with pytest.raises(ConfigError, match="'b' selects both 'a' and 'b'"):
        repository_for(config)


@pytest.mark.parametrize("key, value", [("memory_budget", "lots"), ("keep_alive", "soon"), ("keep_alive", "-5")])
def test_bad_section_values_fail_at_start_up(key, value):
    with pytest.raises(ConfigError, match=f"\\[models\\] {key}"):
        parse_config(f"[models]\n{key} = {value}\n")


def test_memory_budget_share_is_of_available_ram():
    assert memory_budget(parse_config(""), 1000) == 600
    assert math.isinf(PINNED)

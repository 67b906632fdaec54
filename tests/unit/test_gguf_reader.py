"""shared.gguf_reader reads exactly what gguf.GGUFReader reads, and names what is wrong."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from shared.errors import ModelLoadError, TokenizerError
from shared.gguf_reader import GGUFFormatError, read_header
from shared.vocab import read_vocab
from tests.model.tiny_gguf import TinyModel, write_tiny
from worker.engine.gguf_file import GGUFFile


def _same_as_gguf_reader(path) -> None:
    ours = read_header(path)
    ref = gguf.GGUFReader(path)
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        value = ours.fields[key]
        expected = field.contents()
        assert (value.tolist() if isinstance(value, np.ndarray) else value) == expected, key
    assert [(t.name, list(t.shape), t.qtype, t.offset, t.n_bytes) for t in ours.tensors] == \
        [(t.name, t.shape.tolist(), int(t.tensor_type), t.data_offset, t.n_bytes) for t in ref.tensors]


def test_matches_gguf_reader_on_a_written_file(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny(path, TinyModel(arch="qwen2"))
    _same_as_gguf_reader(path)


def test_matches_gguf_reader_on_the_real_models(smollm2_gguf, gemma3_gguf):
    _same_as_gguf_reader(smollm2_gguf)
    _same_as_gguf_reader(gemma3_gguf)


def test_every_value_type_round_trips(tmp_path):
    path = tmp_path / "kv.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200); w.add_int16("t.i16", -3); w.add_uint64("t.u64", 2**40)
    w.add_float64("t.f64", 0.1); w.add_bool("t.bool", True); w.add_string("t.str", "héllo")
    w.add_array("t.ints", [1, 2, 3]); w.add_array("t.strs", ["a", "ü", ""])
    w.write_header_to_file(); w.write_kv_data_to_file(); w.close()
    f = read_header(path).fields
    assert (f["t.u8"], f["t.i16"], f["t.u64"], f["t.f64"], f["t.bool"], f["t.str"]) == (200, -3, 2**40, 0.1, True, "héllo")
    assert f["t.ints"].tolist() == [1, 2, 3] and f["t.strs"] == ["a", "ü", ""]


@pytest.mark.parametrize("cut", [3, 30, 200])
def test_truncated_header_is_a_format_error(tmp_path, cut):
    path = tmp_path / "tiny.gguf"
    write_tiny(path, TinyModel())
    short = tmp_path / "short.gguf"
    short.write_bytes(path.read_bytes()[:cut])
    with pytest.raises(GGUFFormatError):
        read_header(short)


def test_wrong_magic_is_a_format_error(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + b"\0" * 60)
    with pytest.raises(GGUFFormatError, match="bad magic"):
        read_header(path)


@pytest.mark.parametrize("content", [b"this is no model", b"x" * 100])
def test_a_file_that_is_not_gguf_reads_the_same_in_gateway_and_worker(tmp_path, content):
    # `reame serve` reports whichever process reads the model first; a 16-byte file once made the
    # gateway say "file too small" where the worker says "not a GGUF file" (a flaky CI run).
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(TokenizerError, match="not a GGUF file"):
        read_vocab(path)
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        GGUFFile(path)

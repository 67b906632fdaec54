"""Bad model files give one clear ModelLoadError, never a traceback from the gguf package."""
from __future__ import annotations

import hashlib
import os

import gguf
import numpy as np
import pytest

from shared.errors import ModelLoadError
from tests.model.tiny_gguf import TinyLlama, write_tiny, write_tiny_llama
from worker.engine.engine import load_engine
from worker.engine.gguf_file import GGUFFile


def _load(path):
    return load_engine(path, progress=lambda m: None)


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="model file not found"):
        _load(tmp_path / "nope.gguf")


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("hello, I am not a model")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        _load(path)


def test_truncated_file(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, TinyLlama())
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelLoadError, match="truncated|not a valid GGUF"):
        _load(cut)


def test_header_only_file(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, TinyLlama())
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:64])
    with pytest.raises(ModelLoadError):
        _load(cut)


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ModelLoadError, match="unsupported architecture 'mamba'"):
        _load(path)


def test_unsupported_quant_type(tmp_path):
    path = tmp_path / "iq.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    # IQ4_NL: 18 bytes per 32 weights, a type Reame does not support.
    w.add_tensor("token_embd.weight", np.zeros((4, 18), np.uint8), raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ModelLoadError, match="unsupported tensor type IQ4_NL"):
        _load(path)


def test_missing_tensor(tmp_path):
    path = tmp_path / "partial.gguf"
    spec = TinyLlama()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1); w.add_context_length(64); w.add_embedding_length(64); w.add_feed_forward_length(96)
    w.add_head_count(4); w.add_layer_norm_rms_eps(1e-5)
    w.add_tensor("token_embd.weight", np.zeros((spec.vocab, 64), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ModelLoadError, match="required tensor blk.0.attn_q.weight is missing"):
        _load(path)


def test_unreadable_file(tmp_path, monkeypatch):
    # chmod 000 cannot stop root (CI runs as root), so the refusal is simulated at open().
    import builtins
    path = tmp_path / "locked.gguf"
    write_tiny_llama(path, TinyLlama())
    real_open = builtins.open

    def deny(file, *args, **kwargs):
        if str(file) == str(path):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", deny)
    with pytest.raises(ModelLoadError, match="cannot read model file .*locked.gguf: Permission denied"):
        _load(path)


def test_a_model_replaced_with_an_older_mtime_gets_a_new_fingerprint(tmp_path):
    """cp -p, rsync -a and mv keep a file's older mtime: the sidecar must not vouch for the new bytes."""
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, TinyLlama())
    first = GGUFFile(path).fingerprint()
    assert (tmp_path / "tiny.gguf.sha256").read_text().split()[0] == first  # recorded: later loads skip the hash
    assert GGUFFile(path).fingerprint() == first

    other = tmp_path / "other.gguf"
    write_tiny(other, TinyLlama(), seed=1)
    before = path.stat()
    os.utime(other, ns=(before.st_atime_ns - 10**9, before.st_mtime_ns - 10**9))
    os.replace(other, path)  # now older than its sidecar
    replaced = GGUFFile(path).fingerprint()
    assert replaced == hashlib.sha256(path.read_bytes()).hexdigest() != first

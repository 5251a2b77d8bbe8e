"""Bring your own draft: EAGLE-3 heads in speculators' (vLLM), SpecForge / SGLang's and the EAGLE authors' formats load
as feature drafters. Our head exported to each format and read back drafts the same tokens with the same
probabilities, decodes greedily exactly as the target, and a head for another target or with missing or extra
tensors is refused naming the file, the mismatch and the fix. A head the speculators package builds itself matches
its own forward."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sacpolicy.decoding.aux import AuxCapture
from sacpolicy.decoding.eagle3 import Eagle3Config, Eagle3Head, load_head, vocab_hash
from sacpolicy.decoding.eagle3_formats import EAGLE, SACPOLICY, SPECFORGE, SPECULATORS, HeadFormatError, read_head_dir
from sacpolicy.decoding.feature import FeatureDrafter, load_feature_drafter
from sacpolicy.export.speculators import export_sglang, export_speculators
from sacpolicy.training.eagle3 import save_head

AUX = [2, 4, 5]  # [2, L // 2, L - 3] for L = 8: the default of the formats that record no aux layers
FORMATS = {"sacpolicy": SACPOLICY, "speculators": SPECULATORS, "sglang": SPECFORGE, "eagle": EAGLE}


def tiny_target(layers=8, hidden=64, vocab=512, spec="test:tiny-llama-8l-v512"):
    """A tiny random Llama over the first ``vocab`` token ids, logits sharpened 25x (final norm scaled) so that its
    continuations are peaked like a trained model's and repeat across prompts."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from sacpolicy.models import TINY_PRESETS, LoadedModel, load_tokenizer

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**{**TINY_PRESETS["llama-4l"], "num_hidden_layers": layers,
                                                "hidden_size": hidden, "vocab_size": vocab})).eval()
    with torch.no_grad():
        model.model.norm.weight.mul_(25)
    return LoadedModel(model, load_tokenizer("tiny:llama-4l"), spec=spec)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def sequences(target):
    """Token sequences: random prompts and the target's sampled continuations."""
    prompts = torch.randint(3, 512, (4, 6), generator=torch.Generator().manual_seed(0))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return target.model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=24,
                                     do_sample=True, top_k=0, eos_token_id=None, pad_token_id=0)


def random_head(target, vocab=100, seed=0, aux=AUX, **flags) -> Eagle3Head:
    """A head for ``target`` with large random weights (every part of the computation matters) and a strided draft
    vocabulary; ``flags``: Eagle3Config variants (norm_before_residual, ...)."""
    cfg = dataclasses.replace(Eagle3Config.from_target(target.model.config, vocab, aux_layer_ids=aux,
                                                       verifier=target.spec, vocab_hash=vocab_hash(target.tokenizer)),
                              **flags)
    head = Eagle3Head(cfg, target.model.get_input_embeddings())
    stride = target.model.config.vocab_size // vocab
    head.set_vocab(torch.arange(vocab) * stride + int(stride > 1))
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for p in head.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return head.eval()


def write_format(fmt: str, head: Eagle3Head, target, tmp: Path) -> Path:
    """``head`` written in ``fmt``: ours, our speculators and SGLang exports, and an EAGLE authors' release (SGLang's
    layout with a transformers-4 config that records no aux layers, a pytorch_model.bin with the embedding)."""
    ours = save_head(head, tmp / "ours", {})
    if fmt == "sacpolicy":
        return ours
    if fmt == "speculators":
        return export_speculators(ours, tmp / "speculators", verifier_path=target.spec)
    sglang = export_sglang(ours, tmp / "sglang")
    if fmt == "sglang":
        return sglang
    config = json.loads((sglang / "config.json").read_text())
    for key in ("eagle_config", "rope_parameters", "head_dim"):
        config.pop(key)
    out = tmp / "eagle"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({**config, "transformers_version": "4.28.1"}))
    tensors = load_file(str(sglang / "model.safetensors"))
    tensors["embed_tokens.weight"] = target.model.get_input_embeddings().weight.detach().clone()
    torch.save(tensors, out / "pytorch_model.bin")
    return out


def speculators_logits(model, x, a, steps: int) -> list:
    """The draft logits of each training-time-test step of a speculators ``Eagle3DraftModel`` on ids ``x`` [1, T]
    and aux features ``a`` [1, T, A] (its own forward, read at its LM head)."""
    theirs = []
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: theirs.append(out))
    try:
        T = x.shape[1]
        model(hidden_states=a, input_ids=x, document_ids=torch.zeros(1, T, dtype=torch.long), ttt_steps=steps)
    finally:
        hook.remove()
    return theirs


def features(target, ids, aux=AUX) -> torch.Tensor:
    """ids [n] -> the target's aux hidden states [n, len(aux) * H]."""
    capture = AuxCapture(target.model, aux)
    with capture, torch.no_grad():
        target.model(input_ids=ids.view(1, -1))
    return capture.rows(aux)


def drafts(drafter, sequences, target, aux=AUX):
    """Every greedy chain of 3 the drafter proposes along each sequence, and the first draft token's logits."""
    out = []
    for ids in sequences:
        tf = drafter.teacher_force(ids, 6, 3, features(target, ids, aux))
        out.append((tf.tokens, tf.logits))
    return out


# ---------------------------------------------------------------------- round trips
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_our_head_in_each_format_loads_back_and_drafts_the_same(fmt, target, sequences, tmp_path):
    head = random_head(target, seed=1)
    path = write_format(fmt, head, target, tmp_path)
    ckpt = read_head_dir(path, target.model.config)
    assert ckpt.format == FORMATS[fmt] and ckpt.config["aux_layer_ids"] == AUX
    drafter = load_feature_drafter(target, path)
    loaded = drafter.head.config
    assert loaded == dataclasses.replace(head.config, verifier=loaded.verifier, vocab_hash=loaded.vocab_hash)
    assert torch.equal(drafter.head.draft_ids, head.draft_ids) and torch.equal(drafter.head.t2d, head.t2d)
    for (a_tok, a_logits), (b_tok, b_logits) in zip(drafts(FeatureDrafter(head), sequences, target),
                                                    drafts(drafter, sequences, target)):
        assert torch.equal(a_tok, b_tok) and torch.equal(a_logits, b_logits)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_greedy_decoding_with_each_loaded_format_is_the_targets_own(fmt, target, sequences, tmp_path):
    """Lossless through the real decoder, built the way ``draft=feature draft.feature.path=<dir>`` builds it; the loaded
    head's blocks and draft probabilities equal those of the head it was exported from."""
    from sacpolicy.build import build_drafter
    from sacpolicy.decoding import DecoderConfig, RequestInfo, SpeculativeDecoder
    from sacpolicy.policy import Static
    from sacpolicy.runtime.spec import DrafterSpec

    head = random_head(target, vocab=200, seed=3)
    path = write_format(fmt, head, target, tmp_path)
    loaded = build_drafter(DrafterSpec(kind="feature", name="feature", path=str(path)), target)
    decoders = [SpeculativeDecoder(target.model, [d], Static(3), config=DecoderConfig(step_stats=True),
                                   stop_token_ids=[]) for d in (FeatureDrafter(head), loaded)]
    for ids in sequences[:2]:
        prompt = ids[:6].tolist()
        ref = target.model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 6, dtype=torch.long),
                                    max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)[0, 6:]
        runs = [dec.generate(prompt, 16, request=RequestInfo()) for dec in decoders]
        for res in runs:
            assert res.tokens == ref.tolist() and not res.dropped_drafters
        assert sum(s.drafted for s in runs[1].steps) > 0
        assert [(s.drafted, s.accepted, s.q) for s in runs[0].steps] == [(s.drafted, s.accepted, s.q)
                                                                         for s in runs[1].steps]


@pytest.mark.parametrize("fmt, flags", [
    ("speculators", {"norm_before_residual": True, "fc_norm": True, "norm_output": True}),
    ("speculators", {"norm_before_fc": True}),
    ("sglang", {}),
])
def test_variants_and_aux_layers_listed_out_of_order_survive_export(fmt, flags, target, sequences, tmp_path):
    """A head reading its aux layers as [5, 2, 4] is exported in layer order (the order engines concatenate them in),
    fc's blocks and per-aux norms permuted with them; speculators' variant flags travel with it, SGLang's layout
    refuses them, and both exports refuse a Qwen3 layer's q/k norms (those heads load, they are not written)."""
    head = random_head(target, seed=5, aux=[5, 2, 4], **flags)
    path = write_format(fmt, head, target, tmp_path)
    assert read_head_dir(path, target.model.config).config["aux_layer_ids"] == AUX
    want = drafts(FeatureDrafter(head), sequences[:2], target, aux=[5, 2, 4])
    got = drafts(load_feature_drafter(target, path), sequences[:2], target)
    for (a_tok, a_logits), (b_tok, b_logits) in zip(want, got):
        torch.testing.assert_close(b_logits, a_logits, atol=1e-4, rtol=1e-4)  # fc sums in another order
        assert torch.equal(a_tok, b_tok)
    if flags:
        with pytest.raises(ValueError, match="SGLang's LlamaForCausalLMEagle3 runs the plain EAGLE-3 layer"):
            export_sglang(tmp_path / "ours", tmp_path / "sglang")
    qwen3 = save_head(random_head(target, qk_norm=True), tmp_path / "qwen3", {})
    with pytest.raises(ValueError, match="Qwen3 decoder layer"):
        export_speculators(qwen3, tmp_path / "qwen3-speculators", verifier_path=target.spec)


def test_rope_scaling_spelled_the_transformers_4_way_reads_as_it_was_trained(target, sequences, tmp_path):
    """Llama 3.1's rope (theta 500000, llama3 scaling), as an EAGLE authors' config spells it: ``rope_theta`` beside a
    ``rope_scaling`` with the older ``type`` key; the head keeps it and drafts as it did."""
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    head = random_head(target, seed=6, rope_theta=500000.0, rope_scaling=llama3)
    path = write_format("eagle", head, target, tmp_path)
    config = json.loads((path / "config.json").read_text())
    assert "rope_parameters" not in config
    config["rope_scaling"] = {**{k: v for k, v in llama3.items() if k != "rope_type"}, "type": "llama3"}
    (path / "config.json").write_text(json.dumps(config))
    drafter = load_feature_drafter(target, path)
    assert drafter.head.config.rope_theta == 500000.0 and drafter.head.config.rope_scaling == llama3
    for (a_tok, a_logits), (b_tok, b_logits) in zip(drafts(FeatureDrafter(head), sequences[:2], target),
                                                    drafts(drafter, sequences[:2], target)):
        assert torch.equal(a_tok, b_tok) and torch.equal(a_logits, b_logits)
    plain = drafts(FeatureDrafter(random_head(target, seed=6)), sequences[:1], target)
    assert not torch.equal(plain[0][1], drafts(drafter, sequences[:1], target)[0][1])  # the scaling matters here


def test_the_shipped_head_in_each_format_drafts_for_the_embedded_target_as_it_does(embedded, tmp_path):
    """A trained head over a real target (30 layers, 8192 of 49152 ids): its aux layers [2, 15, 27] are the EAGLE
    authors' default, so their format, which records none, reads it too; every format proposes the same chains."""
    from sacpolicy.heads import shipped_head
    from sacpolicy.models import EMBEDDED_TARGET

    ours = shipped_head(EMBEDDED_TARGET)
    head = load_feature_drafter(embedded, ours).head
    assert head.config.aux_layer_ids == [2, 15, 27]
    text = "def fib(n):\n    if n < 2:\n        return n\n    return"
    ids = embedded.tokenizer(text, return_tensors="pt").input_ids[0]
    want = drafts(FeatureDrafter(head), [ids], embedded, head.config.aux_layer_ids)
    for fmt in ("speculators", "sglang", "eagle"):
        path = write_format(fmt, head, embedded, tmp_path / fmt)
        got = drafts(load_feature_drafter(embedded, path), [ids], embedded, head.config.aux_layer_ids)
        assert torch.equal(got[0][0], want[0][0]) and torch.equal(got[0][1], want[0][1]), fmt


def test_vocabulary_maps_in_other_conventions_load_as_the_same_head(target, sequences, tmp_path):
    """d2t as absolute ids without t2d, and a draft vocabulary in another order (lm_head rows permuted with it), load as
    the head they describe."""
    head = random_head(target, seed=2)
    path = write_format("speculators", head, target, tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    ids = tensors["d2t"] + torch.arange(100)
    absolute = {k: v for k, v in tensors.items() if k not in ("d2t", "t2d")} | {"d2t": ids}
    perm = torch.randperm(100, generator=torch.Generator().manual_seed(0))
    shuffled = {**tensors, "d2t": ids[perm] - torch.arange(100), "lm_head.weight": tensors["lm_head.weight"][perm]}
    want = drafts(FeatureDrafter(head), sequences[:2], target)
    for name, variant in (("absolute", absolute), ("shuffled", shuffled)):
        save_file(variant, str(path / "model.safetensors"))
        got = drafts(load_feature_drafter(target, path), sequences[:2], target)
        for (a_tok, a_logits), (b_tok, b_logits) in zip(want, got):
            assert torch.equal(a_tok, b_tok) and torch.equal(a_logits, b_logits), name


def test_a_head_without_a_vocabulary_map_drafts_over_the_whole_vocabulary(target, sequences, tmp_path):
    head = random_head(target, vocab=512, seed=4)
    path = write_format("speculators", head, target, tmp_path)
    assert "d2t" not in load_file(str(path / "model.safetensors"))  # speculators keeps no map then
    got = drafts(load_feature_drafter(target, path), sequences[:1], target)
    want = drafts(FeatureDrafter(head), sequences[:1], target)
    assert torch.equal(got[0][0], want[0][0]) and torch.equal(got[0][1], want[0][1])


# ---------------------------------------------------------------------- refusals
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_head_for_another_target_is_refused_naming_file_mismatch_and_fix(fmt, target, tmp_path):
    other = tiny_target(hidden=32, vocab=600, spec="test:other")
    path = write_format(fmt, random_head(other), other, tmp_path)
    with pytest.raises(ValueError, match=r"(?s)" + re.escape(str(path / "config.json"))
                       + r".*belongs to another target.*hidden size: head 32, target 64.*"
                       r"vocabulary size: head 600, target 512.*Fix: load the target it was trained for"):
        load_feature_drafter(target, path)


def test_a_head_naming_another_verifier_or_reading_layers_the_target_lacks_is_refused(target, tmp_path):
    head = random_head(target)
    path = write_format("speculators", head, target, tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["speculators_config"]["verifier"]["name_or_path"] = "meta-llama/Llama-3.1-8B-Instruct"
    config["eagle_aux_hidden_state_layer_ids"] = [2, 4, 8]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"(?s)verifier: trained for 'meta-llama/Llama-3.1-8B-Instruct'.*"
                                         r"aux layers: the head reads the inputs of decoder layers \[2, 4, 8\]"):
        load_feature_drafter(target, path)
    # the same model under a local path: accepted (the last path component names it)
    config["speculators_config"]["verifier"]["name_or_path"] = f"/models/{target.spec}"
    config["eagle_aux_hidden_state_layer_ids"] = AUX
    (path / "config.json").write_text(json.dumps(config))
    assert load_feature_drafter(target, path).aux_layers == tuple(AUX)


@pytest.mark.parametrize("fmt, missing, extra", [
    ("sacpolicy", "layers.0.mlp.down_proj.weight", "layers.0.extra.weight"),
    ("speculators", "norm.weight", "layers.1.self_attn.q_proj.weight"),
    ("sglang", "midlayer.hidden_norm.weight", "midlayer.extra.weight"),
])
def test_missing_and_extra_tensors_are_named(fmt, missing, extra, target, tmp_path):
    path = write_format(fmt, random_head(target), target, tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    tensors[extra] = tensors.pop(missing)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"model.safetensors does not hold the tensors its config .* describes: "
                                         rf"missing \['{missing}'\], unexpected \['{extra}'\]"):
        load_feature_drafter(target, path)


class NotATensor:
    pass


def test_bad_directories_fail_clearly(target, tmp_path):
    head = random_head(target)
    eagle, spec, sglang = (write_format(f, head, target, tmp_path / f) for f in ("eagle", "speculators", "sglang"))
    torch.save({"fc.weight": NotATensor()}, eagle / "pytorch_model.bin")  # unpickling would run foreign code
    with pytest.raises(HeadFormatError, match="weights_only=True.*never unpickles"):
        load_feature_drafter(target, eagle)
    target.model.save_pretrained(tmp_path / "causal-lm")  # a draft model is no head
    with pytest.raises(HeadFormatError, match="draft=model draft.draft.path"):
        load_feature_drafter(target, tmp_path / "causal-lm")
    with pytest.raises(FileNotFoundError, match="not an EAGLE-3 head directory"):
        load_feature_drafter(target, tmp_path / "nothing")
    config = json.loads((spec / "config.json").read_text())
    (spec / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "norm_before_residual"}))
    with pytest.raises(HeadFormatError, match="lacks norm_before_residual, which speculators reads as false and vLLM"):
        load_feature_drafter(target, spec)
    config = json.loads((sglang / "config.json").read_text())
    (sglang / "config.json").write_text(json.dumps({**config, "eagle_config": {"use_aux_hidden_state": True}}))
    with pytest.raises(HeadFormatError, match="does not say which target layers"):
        load_head(sglang, target.model.get_input_embeddings())  # no target: no layer count for the default
    tensors = load_file(str(sglang / "model.safetensors"))
    save_file({**tensors, "d2t": torch.zeros(100, dtype=torch.long)}, str(sglang / "model.safetensors"))
    with pytest.raises(HeadFormatError, match="d2t does not map the 100 draft ids onto distinct target ids"):
        load_feature_drafter(target, sglang)


@pytest.mark.parametrize("fmt", ["speculators", "sglang"])
def test_a_truncated_head_download_is_named_with_the_fix(fmt, target, tmp_path):
    """A third-party head whose model.safetensors (or one shard of it) was cut short: HeadFormatError naming the
    file, that it is truncated, and the fix, not safetensors' "incomplete metadata, file not fully covered"."""
    head = write_format(fmt, random_head(target), target, tmp_path)
    weights = head / "model.safetensors"
    if fmt == "sglang":  # a sharded release: the index names the shards, the second one is cut
        tensors = load_file(str(weights))
        names = sorted(tensors)
        shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
        for shard, keys in shards.items():
            save_file({k: tensors[k].contiguous() for k in keys}, str(head / shard))
        (head / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}))
        weights.unlink()
        load_feature_drafter(target, head)  # whole shards load
        weights = head / "model-00002-of-00002.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(HeadFormatError, match=re.escape(str(weights)) + " is truncated: .*download or copy it "
                       "again") as info:
        load_feature_drafter(target, head)
    assert "incomplete metadata" not in str(info.value)


# ---------------------------------------------------------------------- a head the speculators package wrote
VARIANTS = {
    "plain llama": ("llama", {}),
    "speculators' training defaults": ("llama", {"norm_before_residual": True, "norm_before_fc": True}),
    "fc_norm + norm_output": ("llama", {"fc_norm": True, "norm_output": True}),
    "qwen3 layer": ("qwen3", {"norm_before_residual": True}),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@torch.no_grad()
def test_a_head_the_speculators_package_saved_matches_its_own_forward(variant, target, sequences, tmp_path):
    pytest.importorskip("speculators", reason="speculators is not installed (scripts/install.sh: pip install --no-deps "
                        "speculators==0.9.0 hs-connectors==0.9.0 openai==3.57.0 jiter==0.19.0 loguru==0.7.3)")
    from transformers import LlamaConfig, Qwen3Config

    from sacpolicy.models import LoadedModel

    try:
        from speculators.config import SpeculatorsConfig, VerifierConfig
        from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
        from speculators.proposals.greedy import GreedyTokenProposalConfig
    except Exception as exc:  # installed but not importable with this transformers / torch
        pytest.skip(f"speculators is installed but its Eagle3DraftModel does not import here: {exc!r}")
    layer_type, flags = VARIANTS[variant]
    target.model.save_pretrained(tmp_path / "verifier")
    verifier = LoadedModel(target.model, target.tokenizer, spec=str(tmp_path / "verifier"))
    c = target.model.config
    layer = (LlamaConfig if layer_type == "llama" else Qwen3Config)(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=c.rms_norm_eps, max_position_embeddings=2048,
        rope_parameters={"rope_theta": 5000.0, "rope_type": "default"}, tie_word_embeddings=False)
    layer._attn_implementation = "eager"  # its default, flex attention, wants a GPU
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=100, eagle_aux_hidden_state_layer_ids=AUX, **flags,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=verifier.spec, architectures=["LlamaForCausalLM"])))
    model = Eagle3DraftModel(config).eval()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3 if p.dim() > 1 else torch.rand_like(p) + 0.5)
    model.embed_tokens.weight.copy_(target.model.get_input_embeddings().weight)
    ids = torch.arange(100) * 5 + 3
    model.load_vocab_mappings(torch.zeros(512, dtype=torch.bool).index_fill_(0, ids, True), ids - torch.arange(100))
    model.save_pretrained(tmp_path / "spec")

    drafter = load_feature_drafter(verifier, tmp_path / "spec")
    assert read_head_dir(tmp_path / "spec", target.model.config).format == SPECULATORS and drafter.head._embed[0] is (
        target.model.get_input_embeddings())  # the file's embedding equals the target's: shared, not copied
    seq = sequences[0]
    T = seq.numel() - 1
    x, a = seq[1:].view(1, T), features(target, seq)[:T].unsqueeze(0)
    theirs = speculators_logits(model, x, a, 3)
    ours = drafter.head.ttt_forward(x, a, 3)
    assert len(theirs) == 3
    for j in range(3):  # step 0: the first drafted token's logits; steps 1, 2: the chain on the head's own outputs
        torch.testing.assert_close(ours[j], theirs[j], atol=1e-4, rtol=1e-4)

"""Exactness on every architecture the decoder runs: tiny random models of the families users bring (Llama; Gemma 3
with its mix of sliding and full layers; Qwen2 with one sliding layer; Qwen3; Mistral, every layer sliding), windows
of 8 tokens under prompts of 11 to 19, through every drafter (n-gram, suffix, layer-skip, a draft model, the EAGLE-3
feature head's token trees), batched with ragged rows and prefill groups, one row alone, and token trees:

- greedy output identical to transformers' own ``generate``, batched rows identical to each decoded alone;
- the ragged KV cache after rollbacks and token-tree path moves identical to a fresh prefill of the committed tokens;
- sampled decoding (a Gemma 3 target, sliding and full layers, batched) follows the target's distribution;
- a family the decoder cannot run (chunked, linear attention, bidirectional) is refused when it is built."""

import functools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from toys import ModelTreeDrafter
from transformers import AutoConfig, AutoModelForCausalLM, Gemma3TextConfig

from sacpolicy.decoding import (
    DecoderConfig,
    LayerSkipDrafter,
    ModelDrafter,
    NgramDrafter,
    RequestInfo,
    SamplingConfig,
    SpeculativeDecoder,
    SuffixDrafter,
    TokenTree,
)
from sacpolicy.decoding.compat import with_cache
from sacpolicy.decoding.eagle3 import Eagle3Config, Eagle3Head
from sacpolicy.decoding.feature import FeatureDrafter
from sacpolicy.decoding.layout import AttentionLayout, attention_layout
from sacpolicy.decoding.ragged import RaggedCache, new_cache, prefill_inputs
from sacpolicy.models import load_model
from sacpolicy.policy import Static

FAMILIES = {"llama": "llama-4l", "gemma3": "gemma3-2l", "qwen2": "qwen2-2l", "qwen3": "qwen3-2l",
            "mistral": "mistral-2l"}  # family -> its tiny preset
NEW = 16
CPU = torch.device("cpu")


def hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


class Family:
    """A family's tiny target (its preset), a draft of its own family (the target's config, other weights), prompts
    longer than the window and transformers' greedy continuations of them."""

    def __init__(self, name):
        self.name = name
        self.target = load_model(f"tiny:{FAMILIES[name]}", device="cpu", dtype="float32", seed=0).model
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            self.draft = AutoModelForCausalLM.from_config(self.target.config).eval()
        g = torch.Generator().manual_seed(len(name))
        self.prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (11, 19, 14)]
        self.prompts.append([5, 6, 7, 8] * 4)  # repetitive: the n-gram and suffix drafters find blocks
        self.reference = [hf_greedy(self.target, p, NEW) for p in self.prompts]
        with torch.no_grad():  # the spread of the target's logits (random models of some families are flat)
            self.logit_std = float(self.target(input_ids=torch.tensor([self.prompts[0]])).logits.std())

    def head(self, tree: int = 0) -> FeatureDrafter:
        """An untrained EAGLE-3 head reading the target's layers 0 and 1 (random weights: exactness does not need a
        good head)."""
        config = Eagle3Config.from_target(self.target.config, 256, aux_layer_ids=[0, 1])
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            head = Eagle3Head(config, self.target.get_input_embeddings()).float()
        head.set_vocab(torch.arange(256) * 7 + 3)
        return FeatureDrafter(head.eval(), "feature", tree=tree)


@functools.cache
def _family(name: str) -> Family:
    return Family(name)


@pytest.fixture(params=list(FAMILIES))
def family(request):
    """Built once per process (tests of one family may run apart, on either worker)."""
    return _family(request.param)


def test_the_presets_are_the_families_with_windows_shorter_than_the_prompts(family):
    layout = attention_layout(family.target.config)
    windows = {"llama": None, "gemma3": 8, "qwen2": 8, "qwen3": None, "mistral": 8}
    assert layout.window == windows[family.name]
    assert layout.by_type == (family.name in ("gemma3", "qwen2"))  # Mistral: one mask; full-only: unchanged
    assert min(len(p) for p in family.prompts) > 8
    if family.name == "gemma3":
        assert family.target.config.layer_types == ["sliding_attention", "full_attention"]


def _drafter(family, kind):
    return {"ngram": lambda: NgramDrafter(), "suffix": lambda: SuffixDrafter(),
            "layerskip": lambda: LayerSkipDrafter(family.target, 1),
            "draft": lambda: ModelDrafter(family.draft, name="draft"),
            "feature": lambda: family.head(tree=6)}[kind]()


@pytest.mark.parametrize("kind", ["ngram", "suffix", "layerskip", "draft", "feature"])
def test_batched_greedy_equals_generate_for_every_drafter(family, kind):
    """Three rows at a time (four requests: one joins as another finishes; prompts of 11, 14 and 19 tokens prefill
    in two groups), each row its own accepted prefix: every row is transformers' greedy output. The feature head
    drafts token trees."""
    dec = SpeculativeDecoder(family.target, [_drafter(family, kind)], Static(4, tree=6 if kind == "feature" else 0),
                             stop_token_ids=[], config=DecoderConfig(max_batch=3))
    results = dec.generate_batch(family.prompts, NEW)
    assert [r.tokens for r in results] == family.reference
    steps = [s for r in results for s in r.steps]
    assert max(s.batch_size for s in steps) == 3 and sum(s.drafted for s in steps) > 0


def test_one_row_equals_generate_and_its_logits_a_fresh_pass(family):
    """One row alone (the single-sequence path: transformers builds the window's mask over the kept cache), a draft
    model and the n-gram drafter: transformers' greedy output, and the logits behind every new token a fresh pass
    over the committed sequence (the cache after every rollback holds what a prefill would)."""
    dec = SpeculativeDecoder(family.target, [ModelDrafter(family.draft, name="draft"), NgramDrafter()], Static(4),
                             stop_token_ids=[])
    for prompt, ref in zip(family.prompts, family.reference):
        res = dec.generate(prompt, NEW, keep_logits=True)
        assert res.tokens == ref
        with torch.no_grad():
            fresh = family.target(input_ids=torch.tensor([prompt + res.tokens])).logits[0, len(prompt) - 1 : -1]
        torch.testing.assert_close(res.logits, fresh, rtol=1e-4, atol=1e-4)


def test_token_trees_are_exact_and_leave_a_fresh_cache(family):
    """Token trees (the target's own distribution plus a bias, so accepted paths run through other children), two
    rows then the last alone: the greedy output, and logits read from the cache the tree steps moved to their
    accepted paths equal a fresh pass."""
    drafter = ModelTreeDrafter(family.target, scale=0.5 * family.logit_std)
    dec = SpeculativeDecoder(family.target, [drafter], Static(3, tree=6), stop_token_ids=[],
                             config=DecoderConfig(max_batch=2))
    results = dec.generate_batch(family.prompts[:3], NEW, keep_logits=True)
    assert [r.tokens for r in results] == family.reference[:3]
    for p, r in zip(family.prompts, results):
        with torch.no_grad():
            fresh = family.target(input_ids=torch.tensor([p + r.tokens])).logits[0, len(p) - 1 : -1]
        torch.testing.assert_close(r.logits, fresh, rtol=1e-4, atol=1e-4)
    assert sum(s.accepted for r in results for s in r.steps) > 0


def _fresh(model, ids):
    cache = new_cache(model.config)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), **with_cache(model, cache), use_cache=True).logits[0]
    return cache, logits


def test_ragged_cache_after_rollbacks_and_tree_moves_is_a_fresh_prefill(family):
    """The ragged cache driven by hand across the window: three prompts prefilled together, then steps feeding five
    tokens per row and keeping a different number per row (a rollback), row 1 feeding a token tree and keeping a
    path of it (moved to the front). Each step's logits of kept tokens, and at the end every layer's keys and values
    of every row, equal a fresh prefill of the row's committed tokens."""
    model, layout = family.target, attention_layout(family.target.config)
    prompts = family.prompts[:3]
    lengths = [len(p) for p in prompts]
    W = max(lengths)
    ids = torch.tensor([[p[0]] * (W - len(p)) + p for p in prompts])
    cache = new_cache(model.config)
    with torch.no_grad():
        model(input_ids=ids, **with_cache(model, cache), use_cache=True,
              **prefill_inputs(lengths, CPU, torch.float32, layout))
    batch = RaggedCache.prefilled(cache, lengths, CPU, layout=layout)
    seqs = [list(p) for p in prompts]
    g = torch.Generator().manual_seed(1)
    tree = TokenTree.build(torch.zeros(4, dtype=torch.long), [-1, -1, 0, 2])  # root -> 0 -> 2 -> 3, root -> 1
    for step in range(5):
        fed = torch.randint(3, 49152, (3, 5), generator=g)
        kept = [(step + i) % 5 + 1 for i in range(3)]
        columns = [None, None, None]
        trees = [None, tree.attention(5, CPU), None]
        kept[1], columns[1] = (4, [0, 1, 3, 4]) if step % 2 else (2, [0, 2])  # a path: root, 0, (2, 3) or 1
        with torch.no_grad():
            logits = model(input_ids=fed, **with_cache(model, batch.cache), use_cache=True,
                           **batch.inputs(5, torch.float32, trees)).logits
        for i in range(3):
            cols = columns[i] or list(range(kept[i]))
            seqs[i] += fed[i, cols].tolist()
            _, ref = _fresh(model, seqs[i])
            torch.testing.assert_close(logits[i, cols], ref[-len(cols):], rtol=1e-4, atol=1e-4)
        batch.commit(kept, 5, columns)
    assert min(len(s) for s in seqs) > 8 + 10  # rows well past the window
    for i, seq in enumerate(seqs):
        own, _ = _fresh(model, seq)
        for mine, theirs in zip(batch.row_cache(i, model.config).layers, own.layers):
            torch.testing.assert_close(mine.keys, theirs.keys, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(mine.values, theirs.values, rtol=1e-4, atol=1e-4)


def test_window_masks_by_layer_type():
    """The sliding mask keeps, of what full attention allows, the keys within the window of each query's position;
    a model listing layer types gets both masks by type, a Mistral-like one the sliding mask alone."""
    allowed = torch.ones(1, 3, 5, dtype=torch.bool).tril(diagonal=2)
    q, k = torch.tensor([[2, 3, 4]]), torch.arange(5)[None]
    full = AttentionLayout().mask(allowed, q, k, torch.float32)
    assert torch.equal(full[0, 0] == 0, allowed[0])
    both = AttentionLayout(window=2, by_type=True).mask(allowed, q, k, torch.float32)
    assert torch.equal(both["full_attention"], full)
    assert (both["sliding_attention"][0, 0] == 0).int().tolist() == [[0, 1, 1, 0, 0], [0, 0, 1, 1, 0],
                                                                   [0, 0, 0, 1, 1]]
    assert torch.equal(AttentionLayout(window=2).mask(allowed, q, k, torch.float32), both["sliding_attention"])


def _tiny(model_type, **kw):
    config = AutoConfig.for_model(model_type, num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                  num_key_value_heads=1, intermediate_size=32, vocab_size=64, head_dim=16, **kw)
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("model_type, kw, reason", [
    ("llama4_text", dict(attention_chunk_size=8, intermediate_size_mlp=32, num_local_experts=2), "chunked_attention"),
    ("qwen3_next", dict(linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
                        linear_value_head_dim=8, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                        num_experts=2, num_experts_per_tok=1), "linear_attention"),
    ("gemma3_text", dict(use_bidirectional_attention=True), "bidirectionally"),
])
def test_a_family_the_decoder_cannot_run_is_refused_when_built(model_type, kw, reason):
    model = _tiny(model_type, **kw)
    with pytest.raises(ValueError, match=f"cannot run a '{model_type}' target: .*{reason}"):
        SpeculativeDecoder(model)
    with pytest.raises(ValueError, match=f"cannot run a '{model_type}' draft: .*{reason}"):
        ModelDrafter(model)


def _gemma3(seed):
    config = Gemma3TextConfig(vocab_size=6, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
                              sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                              initializer_range=0.3, max_position_embeddings=64)  # wide weights: peaked distributions
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config).eval()


def test_sampled_rows_of_a_sliding_window_target_follow_its_distribution():
    """A Gemma 3 target (a sliding layer of window 4, a full one) of 6 tokens, its own family as the draft, 16 rows
    at a time (ragged: each row keeps its own accepted prefix), at T = 1: the second and third new tokens (drafted
    and verified past the window: the prompt has 10 tokens) follow the target's joint distribution of them
    (chi-square over the 36 pairs)."""
    target, draft = _gemma3(0), _gemma3(1)
    prompt, v = [1, 4, 2, 5, 0, 3, 3, 1, 4, 2], 6
    with torch.no_grad():
        p0 = torch.softmax(target(input_ids=torch.tensor([prompt])).logits[0, -1].double(), -1)
        pairs = torch.tensor([prompt + [a, b] for a in range(v) for b in range(v)])
        p = torch.softmax(target(input_ids=pairs).logits[:, -3:].double(), -1).view(v, v, 3, v)
    # P(t1 = b, t2 = c) = sum_a p(a | x) p(b | x a) p(c | x a b)
    expected = torch.einsum("a,ab,abc->bc", p0, p[:, 0, 1], p[:, :, 2]).numpy().ravel()
    dec = SpeculativeDecoder(target, [ModelDrafter(draft, name="draft")], Static(3),
                             sampling=SamplingConfig(temperature=1.0), stop_token_ids=[],
                             config=DecoderConfig(timing=False, max_batch=16))
    draws, counts = 2400, np.zeros((v, v))
    for start in range(0, draws, 400):
        results = dec.generate_batch([prompt] * 400, 3, requests=[RequestInfo(seed=start + i) for i in range(400)])
        for r in results:
            counts[r.tokens[1], r.tokens[2]] += 1
    assert sum(s.accepted for r in results for s in r.steps) > 0 and expected.max() > 3 / v**2  # not uniform
    _, pval = chisquare(counts.ravel(), expected / expected.sum() * draws)
    assert pval > 1e-3, pval

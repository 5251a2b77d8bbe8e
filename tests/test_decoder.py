"""The decoder is lossless: greedy output equals the target's own greedy ``generate`` token for token, for every
drafter and policy; sampled output follows the target's distribution; bad input fails before decoding."""

import logging

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from toys import Markov, markov_pair, propose_one
from transformers import LlamaConfig

from sacpolicy.decoding import (
    Decision,
    DecoderConfig,
    DraftBlock,
    LayerSkipDrafter,
    ModelDrafter,
    NgramDrafter,
    RequestInfo,
    SamplingConfig,
    SpeculativeDecoder,
)
from sacpolicy.policy import Autoregressive, Confidence, Heuristic, SeedRule, Static


def hf_greedy(model, prompt, n, eos=None):
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=0,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )
    return out[0, len(prompt):].tolist()


def policies():
    return [
        Autoregressive(), Static(1), Static(3), Static(8), Heuristic(k0=2), Confidence(0.4, k=6),
        Confidence(0.0, k=5), SeedRule(k_short=4, k_long=1),
    ]


@pytest.fixture(scope="module")
def tiny_prompts():
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (int(n),), generator=g).tolist() for n in torch.randint(1, 40, (5,), generator=g)]
    # a repetitive prompt so the n-gram drafter finds matches and long blocks get accepted
    prompts.append([5, 6, 7, 8] * 6)
    return prompts


def tiny_drafters(target, draft):
    return [
        ModelDrafter(draft.model, name="draft"),
        ModelDrafter(target.model, name="self"),  # always agrees: whole blocks plus the bonus token
        LayerSkipDrafter(target.model, 2),
        NgramDrafter(),
    ]


@pytest.mark.parametrize("which", range(4), ids=["draft", "self", "layerskip", "ngram"])  # tiny_drafters' order
def test_greedy_equals_target_for_every_drafter_and_policy(tiny_target, tiny_draft, tiny_prompts, which):
    target = tiny_target.model
    drafter = tiny_drafters(tiny_target, tiny_draft)[which]
    for prompt in tiny_prompts:
        ref = hf_greedy(target, prompt, 24)
        for policy in policies():
            res = SpeculativeDecoder(target, [drafter], policy, stop_token_ids=[]).generate(prompt, 24)
            assert res.tokens == ref, (drafter.name, policy, prompt)
            assert sum(s.emitted for s in res.steps) + 1 == len(ref)


def test_self_draft_accepts_whole_blocks(tiny_target, tiny_prompts):
    dec = SpeculativeDecoder(tiny_target.model, [ModelDrafter(tiny_target.model, name="self")], Static(4),
                             config=DecoderConfig(step_stats=True), stop_token_ids=[])
    res = dec.generate(tiny_prompts[0], 21)
    # 1 token from prefill, then 4 blocks of 4 accepted + 1 bonus
    assert [(s.drafted, s.accepted, s.emitted) for s in res.steps] == [(4, 4, 5)] * 4
    assert res.target_calls == 5 and res.acceptance_rate == 1.0
    assert all(b == pytest.approx(1.0, abs=1e-4) for s in res.steps for b in s.beta)
    assert all(q == pytest.approx(p, abs=1e-4) for s in res.steps for q, p in zip(s.q, s.p))


def test_eos_inside_a_block_and_length_limit_inside_a_block(tiny_target, tiny_prompts):
    target = tiny_target.model
    # a prompt whose greedy output has a token first seen mid-sequence: that token becomes the EOS
    for prompt in tiny_prompts:
        ref = hf_greedy(target, prompt, 30)
        fresh = [t for i, t in enumerate(ref) if i >= 2 and ref.index(t) == i]
        if fresh:
            break
    eos = fresh[0]
    expected = ref[: ref.index(eos) + 1]
    assert hf_greedy(target, prompt, 30, eos=eos) == expected
    cut = []
    for k in (3, 4, 8):
        dec = SpeculativeDecoder(target, [ModelDrafter(target, name="self")], Static(k), stop_token_ids=[eos])
        res = dec.generate(prompt, 30)
        assert res.tokens == expected and res.finish_reason == "eos"
        cut += [s.accepted + 1 > s.emitted for s in res.steps]  # EOS ended the block before its end
    assert any(cut)
    for n in (1, 2, 7, 10):
        res = SpeculativeDecoder(target, [ModelDrafter(target, name="self")], Static(4), stop_token_ids=[]).generate(
            prompt, n)
        assert res.tokens == ref[:n] and res.finish_reason == "length"


def test_several_drafters_and_records(tiny_target, tiny_draft, tiny_prompts):
    target = tiny_target.model
    drafters = tiny_drafters(tiny_target, tiny_draft)

    class RoundRobin(Static):
        def decide(self, rows):
            from sacpolicy.policy import Decision

            return [Decision(r.state.drafters[r.state.step % len(r.state.drafters)], 3) for r in rows]

    prompt = tiny_prompts[-1]
    res = SpeculativeDecoder(target, drafters, RoundRobin(3), config=DecoderConfig(step_stats=True),
                             stop_token_ids=[]).generate(prompt, 30)
    assert res.tokens == hf_greedy(target, prompt, 30)
    assert {s.drafter for s in res.steps} == {d.name for d in drafters}
    for s in res.steps:
        assert len(s.top1) == len(s.q) == len(s.p) == len(s.beta) == s.drafted
        assert s.context_len >= len(prompt) + 1 and s.draft_s >= 0 and s.verify_s > 0


def test_drafter_that_raises_is_dropped_and_output_stays_exact(tiny_target, tiny_prompts, caplog):
    target = tiny_target.model

    class Broken(NgramDrafter):
        calls = 0

        def propose(self, rows):
            Broken.calls += 1
            if Broken.calls == 3:
                raise RuntimeError("draft server went away")
            return super().propose(rows)

    prompt = tiny_prompts[-1]
    with caplog.at_level(logging.WARNING):
        res = SpeculativeDecoder(target, [Broken(name="broken")], Static(3), stop_token_ids=[]).generate(prompt, 20)
    assert res.tokens == hf_greedy(target, prompt, 20)
    assert res.dropped_drafters == ["broken"]
    assert "dropped for this request" in caplog.text
    assert all(s.drafter is None for s in res.steps[2:])


def test_capabilities_are_protocols_the_decoder_tests_by_structure(tiny_target, tiny_draft, tiny_prompts):
    from sacpolicy.decoding import Peekable, Policy, ReadsFeatures, Resettable, SuffixDrafter, TeacherForcing

    caps = (Peekable, ReadsFeatures, TeacherForcing, Resettable)
    for drafter, has in [(NgramDrafter(), {Peekable}), (SuffixDrafter(), {Peekable, Resettable, TeacherForcing}),
                         (ModelDrafter(tiny_draft.model), {TeacherForcing}), (_RepeatLast(), set())]:
        assert {c for c in caps if isinstance(drafter, c)} == has, drafter

    class PeekingRepeat(_RepeatLast):  # no base class: a `peek` method makes it peekable
        name = "peeking"

        def peek(self, state, context):
            return ((0.5, 0.0, 0.5),) * 2

    class Record(Policy):
        uses_peeks, seen = True, []

        def decide(self, rows):
            Record.seen += [dict(r.state.peeks) for r in rows]
            return [Decision("repeat", 2) for _ in rows]

    prompt = tiny_prompts[0]
    res = SpeculativeDecoder(tiny_target.model, [_RepeatLast(), PeekingRepeat()], Record(),
                             stop_token_ids=[]).generate(prompt, 6)
    assert res.tokens == hf_greedy(tiny_target.model, prompt, 6)
    assert Record.seen and all(p == {"peeking": ((0.5, 0.0, 0.5),) * 2} for p in Record.seen)


def test_low_acceptance_falls_back_to_autoregressive(tiny_target, tiny_draft, tiny_prompts):
    target = tiny_target.model
    cfg = DecoderConfig(cooldown_floor=0.5, cooldown_steps=4, cooldown_min_steps=2)

    class Zeros(NgramDrafter):  # proposes token 0, which the target never emits here: acceptance 0
        def propose(self, rows):
            return [DraftBlock(torch.zeros(row.k, dtype=torch.long), None) for row in rows]

    prompt = tiny_prompts[0]
    ref = hf_greedy(target, prompt, 30)
    assert 0 not in ref
    dec = SpeculativeDecoder(target, [Zeros(name="zeros")], Static(4), config=cfg, stop_token_ids=[])
    res = dec.generate(prompt, 30)
    assert res.tokens == ref
    flags = [s.cooldown for s in res.steps]
    assert flags[:7] == [False, False, True, True, True, True, False]  # 2 steps observed, 4 of cooldown, retry
    assert all(s.drafted == 0 for s in res.steps if s.cooldown)
    assert all(s.drafted > 0 and s.accepted == 0 for s in res.steps if not s.cooldown)
    assert all(s.drafted == 0 for s in res.steps if s.cooldown)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda t, d: SpeculativeDecoder(t, [ModelDrafter(t, name="x")], Static(20)), "k_max"),
        (lambda t, d: Static(-1), "k must be"),
        (lambda t, d: SpeculativeDecoder(t, [NgramDrafter()], Static(2, drafter="nope")), "not among"),
        (lambda t, d: SpeculativeDecoder(t, [], Static(2)), "needs at least one drafter"),
        (lambda t, d: SpeculativeDecoder(t, [NgramDrafter(), NgramDrafter()], Static(2)), "unique name"),
        (lambda t, d: SpeculativeDecoder(t, [ModelDrafter(d)], Static(2)), "vocabulary"),
        (lambda t, d: SpeculativeDecoder(t, sampling=SamplingConfig(temperature=-1)), "temperature"),
        (lambda t, d: SamplingConfig(top_p=0), "top_p"),
        (lambda t, d: SpeculativeDecoder(t).generate([], 4), "empty prompt"),
        (lambda t, d: SpeculativeDecoder(t).generate(list(range(3, 3000)), 4), "context"),
        (lambda t, d: SpeculativeDecoder(t).generate(torch.ones(2, 4, dtype=torch.long), 4), "one sequence"),
    ],
)
def test_bad_input_is_rejected_before_decoding(tiny_target, make, match):
    from transformers import LlamaForCausalLM

    other = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ValueError, match=match):
        make(tiny_target.model, other)


# ---------------------------------------------------------------- a draft with a smaller vocabulary (padded)
SMALL_VOCAB = 40_000  # of the tiny target's 49,152 ids: about a fifth of its tokens are past the draft's vocabulary


def smaller_vocab_copy(target, vocab: int = SMALL_VOCAB):
    """The target with its embedding and LM head cut to the first ``vocab`` ids: it agrees with the target wherever the
    target's next token and the context's ids are among them (a Qwen2.5-0.5B draft for a 7B target, in miniature)."""
    import copy

    draft = copy.deepcopy(target)
    draft.resize_token_embeddings(vocab)
    assert draft.get_output_embeddings().out_features == vocab == draft.config.vocab_size
    return draft


def test_a_smaller_vocabulary_draft_is_padded_and_greedy_equals_target(tiny_target, tiny_draft, tiny_prompts):
    from transformers import LlamaForCausalLM

    target, V = tiny_target.model, 49152
    random_small = LlamaForCausalLM(LlamaConfig(**{**tiny_draft.model.config.to_dict(), "vocab_size": SMALL_VOCAB}))
    drafters = [ModelDrafter(smaller_vocab_copy(target), name="cut", vocab_size=V),
                ModelDrafter(random_small.eval(), name="small", vocab_size=V)]
    assert [(d.vocab_size, d.pad) for d in drafters] == [(V, V - SMALL_VOCAB)] * 2
    g = torch.Generator().manual_seed(3)
    past = torch.randint(SMALL_VOCAB, V, (6,), generator=g).tolist()  # ids the drafts cannot embed, in the context
    prompts = [*tiny_prompts, tiny_prompts[-1] + past, past + [5, 6, 7]]
    accepted = 0
    for drafter in drafters:
        for prompt in prompts:
            ref = hf_greedy(target, prompt, 20)
            for policy in (Static(3), Heuristic(k0=2), Confidence(0.2, k=5)):
                res = SpeculativeDecoder(target, [drafter], policy, config=DecoderConfig(step_stats=True),
                                         stop_token_ids=[]).generate(prompt, 20)
                assert res.tokens == ref and not res.dropped_drafters, (drafter.name, policy, prompt)
                accepted += sum(s.accepted for s in res.steps if s.drafter == "cut")
    assert accepted > 0  # the cut draft's proposals are target ids, so the target accepts them
    block = propose_one(drafters[0], torch.tensor(prompts[-1]), 3)
    assert block.logits.shape == (3, V) and torch.isinf(block.logits[:, SMALL_VOCAB:]).all()


def test_a_smaller_vocabulary_draft_drafts_rows_together_exactly(tiny_target, tiny_prompts):
    """Batched rows (their caches stacked, ``_propose_together``) read ids past the draft's vocabulary too."""
    target, seen = tiny_target.model, []
    draft = smaller_vocab_copy(target)
    hook = draft.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape[0]), with_kwargs=True)
    g = torch.Generator().manual_seed(4)
    prompts = [p + torch.randint(SMALL_VOCAB, 49152, (3,), generator=g).tolist() for p in tiny_prompts]
    try:
        dec = SpeculativeDecoder(target, [ModelDrafter(draft, name="cut", vocab_size=49152)], Static(3),
                                 stop_token_ids=[], config=DecoderConfig(max_batch=4))
        results = dec.generate_batch(prompts, 16)
    finally:
        hook.remove()
    assert [r.tokens for r in results] == [hf_greedy(target, p, 16) for p in prompts]
    assert max(seen) > 1 and not any(r.dropped_drafters for r in results)


def test_a_larger_vocabulary_draft_is_refused_with_both_sizes(tiny_target, tiny_draft):
    from transformers import LlamaForCausalLM

    big = LlamaForCausalLM(LlamaConfig(**{**tiny_draft.model.config.to_dict(), "vocab_size": 50_000}))
    with pytest.raises(ValueError, match="scores 50000 token ids but the target's vocabulary has 49152") as info:
        ModelDrafter(big, name="big", vocab_size=49152)
    assert "Fix:" in str(info.value)
    unpadded = ModelDrafter(smaller_vocab_copy(tiny_target.model), name="cut")  # no vocab_size: its own width
    with pytest.raises(ValueError, match=r"40000 tokens but the target has 49152.*vocab_size=49152"):
        SpeculativeDecoder(tiny_target.model, [unpadded], Static(2))


def test_model_drafter_pads_a_smaller_draft_and_refuses_a_larger_one(tiny_target, tiny_draft, tmp_path):
    from transformers import LlamaForCausalLM

    from sacpolicy.build import model_drafter

    def save(vocab, name):
        model = LlamaForCausalLM(LlamaConfig(**{**tiny_draft.model.config.to_dict(), "vocab_size": vocab}))
        model.save_pretrained(tmp_path / name)
        tiny_target.tokenizer.save_pretrained(tmp_path / name)  # the same tokenizer, a smaller head
        return str(tmp_path / name)

    drafter = model_drafter(tiny_target, save(SMALL_VOCAB, "small"))
    assert drafter.vocab_size == 49152 and drafter.pad == 49152 - SMALL_VOCAB
    prompt = [5, 6, 7, 8, 45_000, 9]
    res = SpeculativeDecoder(tiny_target.model, [drafter], Static(3), stop_token_ids=[]).generate(prompt, 12)
    assert res.tokens == hf_greedy(tiny_target.model, prompt, 12) and not res.dropped_drafters
    with pytest.raises(ValueError, match="scores 50000 token ids but the target's vocabulary has 49152"):
        model_drafter(tiny_target, save(50_000, "big"))


def test_sampling_with_a_smaller_vocabulary_draft_matches_the_target_at_t07():
    """The draft knows the first 4 of 6 ids (q = 0 for the others); the target emits all 6, so the draft also reads
    ids it has no embedding for. At T = 0.7 the output follows the target's tempered chain."""
    v, vd, t = 6, 4, 0.7
    g = torch.Generator().manual_seed(7)
    P = torch.rand(v, v, generator=g) + 0.05
    P = P / P.sum(-1, keepdim=True)
    Q = torch.rand(vd, vd, generator=g) + 0.05
    Q = Q / Q.sum(-1, keepdim=True)
    dec = SpeculativeDecoder(Markov(P.log()), [ModelDrafter(Markov(Q.log()), name="q", vocab_size=v)],
                             Heuristic(k0=2), sampling=SamplingConfig(temperature=t), stop_token_ids=[])
    draws, counts = 6000, np.zeros((v, v))
    for i in range(draws):
        res = dec.generate([0], 3, request=RequestInfo(seed=i))
        assert not res.dropped_drafters  # the draft read every id the target emitted
        counts[res.tokens[1], res.tokens[2]] += 1
    Pt = torch.softmax(P.log() / t, -1).double()
    expected = ((Pt[0] @ Pt)[:, None] * Pt).numpy().ravel()
    assert counts[:, vd:].sum() > 0 and counts[vd:, :].sum() > 0  # the target's ids past the draft's were emitted
    _, pval = chisquare(counts.ravel(), expected / expected.sum() * draws)
    assert pval > 1e-3, pval


# ---------------------------------------------------------------- sampling through the real decoder loop
def test_decoder_sampling_matches_target_distribution():
    v = 6
    P, Q = markov_pair(v, seed=5)
    sampling = SamplingConfig(temperature=1.0)
    dec = SpeculativeDecoder(Markov(P.log()), [ModelDrafter(Markov(Q.log()), name="q")], Heuristic(k0=2), sampling=sampling,
                             config=DecoderConfig(timing=False), stop_token_ids=[])
    draws = 10_000
    counts = np.zeros((v, v))
    for i in range(draws):
        toks = dec.generate([0], 3, request=RequestInfo(seed=i)).tokens
        counts[toks[1], toks[2]] += 1  # tokens 2 and 3 come from draft + verify blocks
    # P(t2 = a, t3 = b) = sum_x P(x | 0) P(a | x) P(b | a)
    expected = ((P[0] @ P)[:, None] * P).double().numpy().ravel()
    _, pval = chisquare(counts.ravel(), expected / expected.sum() * draws)
    assert pval > 1e-3, pval


# ---------------------------------------------------------------- the real embedded target
@pytest.mark.slow
def test_embedded_greedy_equals_generate(embedded):
    from sacpolicy.data import load_prompts

    target = embedded.model
    chat = load_prompts("mt_bench", tokenizer=embedded.tokenizer, limit=1)
    code = load_prompts("humaneval", tokenizer=embedded.tokenizer, limit=1)
    eos = embedded.eos_token_ids
    for ids in [chat[0]["input_ids"], code[0]["input_ids"]]:
        ref = hf_greedy(target, ids, 24, eos=eos)
        for drafter, policy in [
            (LayerSkipDrafter(target, 6), Static(3)),
            (NgramDrafter(), Heuristic()),
            (LayerSkipDrafter(target, 30), Confidence(0.4, k=5)),
        ]:
            res = SpeculativeDecoder(target, [drafter], policy, stop_token_ids=eos).generate(ids, 24)
            assert res.tokens == ref, (drafter.name, policy)
        assert embedded.tokenizer.decode(ref).strip()


def test_layer_skip_view_shares_weights_not_structure(tiny_target):
    from sacpolicy.decoding.drafters import truncated_view

    target = tiny_target.model
    view = truncated_view(target, 2)
    assert len(target.model.layers) == 4 and len(view.model.layers) == 2
    assert target.config.num_hidden_layers == 4 and view.config.num_hidden_layers == 2
    assert view.model.layers[1].self_attn.q_proj.weight is target.model.layers[1].self_attn.q_proj.weight
    assert view.lm_head.weight.data_ptr() == target.lm_head.weight.data_ptr()
    calls = []
    handle = target.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        view(input_ids=torch.tensor([[5, 6]]))
        assert calls == []  # a hook on the target does not fire for the draft view
    finally:
        handle.remove()
    with pytest.raises(ValueError, match="num_layers"):
        truncated_view(target, 5)


def test_kept_logits_are_the_targets_distributions_of_each_new_token(tiny_target, tiny_draft, tiny_prompts):
    """keep_logits returns, row for row, what a teacher-forced target pass over prompt + output computes, whatever
    the policy (AR rows come from single-token steps, speculative rows from verify passes)."""
    target = tiny_target.model
    prompt = tiny_prompts[-1]
    for policy in (Autoregressive(), Static(3)):
        dec = SpeculativeDecoder(target, tiny_drafters(tiny_target, tiny_draft), policy, stop_token_ids=[])
        res = dec.generate(prompt, 20, keep_logits=True)
        assert res.logits.shape == (len(res.tokens), target.config.vocab_size)
        ids = torch.tensor([prompt + res.tokens])
        with torch.no_grad():
            ref = target(input_ids=ids).logits[0, len(prompt) - 1 : -1]
        torch.testing.assert_close(res.logits, ref, rtol=1e-4, atol=1e-4)
        assert res.logits.argmax(-1).tolist() == res.tokens  # greedy: each token is its row's argmax
    assert dec.generate(prompt, 5).logits is None  # off by default: nothing is kept


def test_step_statistics_are_opt_in_and_change_nothing_else(tiny_target, tiny_draft, tiny_prompts):
    """Without ``step_stats`` the records carry no per-token statistics; with them, the same tokens and the same
    steps, greedy and sampled, one row and batched."""
    drafters = tiny_drafters(tiny_target, tiny_draft)
    fields = lambda r: (r.tokens, [(s.drafter, s.k, s.drafted, s.accepted, s.emitted) for s in r.steps])
    for sampling in (SamplingConfig(), SamplingConfig(temperature=0.8, seed=3)):
        runs = {}
        for stats in (False, True):
            dec = SpeculativeDecoder(tiny_target.model, drafters, Heuristic(k0=3, drafter="draft"), sampling=sampling,
                                     config=DecoderConfig(step_stats=stats, max_batch=3), stop_token_ids=[])
            runs[stats] = [dec.generate(tiny_prompts[0], 20)] + dec.generate_batch(tiny_prompts[:4], 20)
        assert [fields(r) for r in runs[False]] == [fields(r) for r in runs[True]]
        assert all(not s.top1 and not s.beta for r in runs[False] for s in r.steps)
        assert all(len(s.top1) == len(s.beta) == s.drafted for r in runs[True] for s in r.steps)
        assert sum(s.drafted for r in runs[True] for s in r.steps) > 0


class _RepeatLast:
    """A drafter that proposes the last token k times without leaving the device: the core protocol by structure
    alone (no base class, no capability)."""

    name, vocab_size = "repeat", None

    def new_state(self):
        return None

    def propose(self, rows):
        from sacpolicy.decoding import DraftBlock

        return [DraftBlock(row.context[-1:].repeat(row.k), logits=None) for row in rows]

    def accept(self, state, n):
        pass


def test_one_host_read_per_step_for_the_whole_batch(tiny_target, tiny_prompts, monkeypatch):
    """A step reads the device back once for all its rows (not once per row), drafted or autoregressive."""
    reads = []
    for name in ("tolist", "item", "__int__", "__bool__", "__float__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original, _n=name, **k: (reads.append(_n),
                                                                                            _o(self, *a, **k))[1])
    for policy in (Static(3, "repeat"), Autoregressive()):
        dec = SpeculativeDecoder(tiny_target.model, [_RepeatLast()], policy,
                                 config=DecoderConfig(max_batch=4, cpu_kernels=False), stop_token_ids=[])
        step, per_step = dec.step, []

        def counted(batch, cache, _step=step):
            reads.clear()
            out = _step(batch, cache)
            per_step.append((len(batch), len(reads)))
            return out

        dec.step = counted
        results = dec.generate_batch(tiny_prompts[:4], 12)
        assert all(len(r.tokens) == 12 for r in results)
        assert per_step and all(n == 1 for _, n in per_step), per_step
        assert max(b for b, _ in per_step) == 4

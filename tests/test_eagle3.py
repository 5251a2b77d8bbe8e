"""EAGLE-3 head: the training-time test sees exactly the inference attention, the drafter's one-pass teacher forcing
equals its proposals, training helps, checkpoints round-trip, bad inputs fail clearly, exports load in speculators."""

import functools
import importlib.util
import json

import lightning as L
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from toys import propose_one

from sacpolicy.decoding.eagle3 import Eagle3Config, Eagle3Head, KVCache, load_head, ttt_mask, vocab_hash
from sacpolicy.decoding.feature import FeatureDrafter, load_feature_drafter
from sacpolicy.decoding.sampling import SamplingConfig
from sacpolicy.decoding.teacher import propose_each
from sacpolicy.decoding.types import DraftRow
from sacpolicy.export.speculators import export_sglang, export_speculators
from sacpolicy.training.eagle3 import Eagle3Settings, save_head, train_eagle3
from sacpolicy.training.eagle3_data import build_feature_cache, capture_features

AUX = [1, 2, 3]


def random_head(target, vocab=100, seed=0, aux=AUX) -> Eagle3Head:
    """A head with large random weights (so every part of the computation matters) and a strided draft vocabulary."""
    cfg = Eagle3Config.from_target(target.model.config, vocab, aux_layer_ids=aux, verifier=target.spec,
                                   vocab_hash=vocab_hash(target.tokenizer))
    head = Eagle3Head(cfg, target.model.get_input_embeddings())
    head.set_vocab(torch.arange(vocab) * (target.model.config.vocab_size // vocab) + 1)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for p in head.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return head.eval()


@pytest.fixture(scope="module")
def tiny_target():
    """A tiny random 4-layer Llama (the ``tiny:llama-4l`` shape) over the first 512 token ids, logits sharpened 25x
    (final norm scaled) so its distributions are peaked like a trained model's (random init gives near-uniform ones,
    whose argmax no draft can learn) and its continuations share tokens across prompts."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from sacpolicy.models import TINY_PRESETS, LoadedModel, load_tokenizer

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**{**TINY_PRESETS["llama-4l"], "vocab_size": 512})).eval()
    with torch.no_grad():
        model.model.norm.weight.mul_(25)
    return LoadedModel(model, load_tokenizer("tiny:llama-4l"), spec="test:tiny-llama-4l-v512")


@pytest.fixture(scope="module")
def sequences(tiny_target):
    """Prompts of random tokens and the target's sampled continuations: rows (input_ids, prompt_len)."""
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 512, (60, 6), generator=g)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        out = tiny_target.model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=26,
                                         do_sample=True, temperature=1.0, top_k=0, eos_token_id=None, pad_token_id=0)
    return [{"input_ids": row.tolist(), "prompt_len": 6} for row in out]


def features(target, ids, aux=AUX) -> torch.Tensor:
    """ids [n] -> the target's aux hidden states [n, len(aux) * H]."""
    a, _ = capture_features(target.model, ids.view(1, -1), torch.ones(1, ids.numel(), dtype=torch.long), aux)
    return a[0]


def test_a_rows_captured_features_are_its_own(tiny_target):
    """``AuxCapture.rows`` of one row of a batched pass: that row's positions of each layer, in the order asked, in a
    tensor of their own (a feature drafter keeps it until its next proposal; a view into the batch's concatenation
    kept the whole batch alive, once per row and step)."""
    from sacpolicy.decoding.aux import AuxCapture

    capture = AuxCapture(tiny_target.model, [2, 0])
    ids = torch.randint(3, 512, (3, 5), generator=torch.Generator().manual_seed(0))
    with capture, torch.no_grad():
        tiny_target.model(input_ids=ids)
    whole = capture.batch([2, 0])
    assert whole.shape[:2] == (3, 5)
    row = capture.rows([2, 0], 4, row=1)
    assert torch.equal(row, whole[1, :4])
    assert row.untyped_storage().nbytes() == row.numel() * row.element_size()
    assert torch.equal(capture.rows([0]), capture.batch([0])[0])


def test_ttt_mask_pattern():
    m = ttt_mask(torch.tensor([[True, True, True]]), 2)[0, 0].int()
    expected = [[1, 0, 0, 1, 0, 0, 1, 0, 0],
                [1, 1, 0, 0, 1, 0, 0, 1, 0],
                [1, 1, 1, 0, 0, 1, 0, 0, 1]]
    assert m.tolist() == expected
    padded = ttt_mask(torch.tensor([[True, False, False]]), 0)[0, 0].int()
    assert padded.tolist() == [[1, 0, 0], [1, 1, 0], [1, 0, 1]]  # padded keys hidden, every row sees itself


@torch.no_grad()
def test_ttt_logits_equal_cached_inference(tiny_target, sequences):
    """Step j of the training-time test at row t = the head fed rows 0..t through its KV cache, then j chain steps
    on its own outputs with the true tokens: training and inference see the same attention."""
    head = random_head(tiny_target)
    ids = torch.tensor(sequences[0]["input_ids"])
    aux = features(tiny_target, ids)
    T, steps = ids.numel() - 1, 4
    x, a = ids[1:].view(1, T), aux[:T].unsqueeze(0)
    ttt = head.ttt_forward(x, a, steps)
    for t in range(T):
        cache = KVCache()
        out, logits = head(head.fc(a[:, : t + 1]), x[:, : t + 1], cache)
        torch.testing.assert_close(logits[0, -1], ttt[0][0, t], atol=2e-5, rtol=1e-5)
        hidden = out[:, -1:]
        for j in range(1, min(steps, T - t)):
            hidden, logits = head(hidden, x[:, t + j : t + j + 1], cache)
            torch.testing.assert_close(logits[0, -1], ttt[j][0, t], atol=2e-5, rtol=1e-5)
    # a right-padded batch gives each sequence's own logits
    ids2 = torch.tensor(sequences[1]["input_ids"][:20])
    aux2 = features(tiny_target, ids2)
    batch_x = torch.zeros(2, T, dtype=torch.long)
    batch_a = torch.zeros(2, T, aux.shape[-1])
    batch_x[0], batch_a[0] = x[0], a[0]
    batch_x[1, :19], batch_a[1, :19] = ids2[1:], aux2[:19]
    valid = torch.arange(T)[None] < torch.tensor([[T], [19]])
    both = head.ttt_forward(batch_x, batch_a, steps, valid)
    alone = head.ttt_forward(batch_x[1:, :19], batch_a[1:, :19], steps)
    for j in range(steps):
        torch.testing.assert_close(both[j][0], ttt[j][0], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(both[j][1, : 19 - j], alone[j][0, : 19 - j], atol=2e-5, rtol=1e-5)


def test_feed_keeps_only_the_logits_it_reads(tiny_target, sequences):
    """logits_to_keep=1 (the drafter's feed of a prompt) gives the last entry's logits of the full pass, same cache."""
    head = random_head(tiny_target)
    ids = torch.tensor(sequences[0]["input_ids"])
    aux = features(tiny_target, ids)
    full_cache, last_cache = KVCache(), KVCache()
    with torch.inference_mode():
        x, a = ids[1:].view(1, -1), head.fc(aux[: ids.numel() - 1].unsqueeze(0))
        out, logits = head(a, x, full_cache)
        out1, last = head(a, x, last_cache, logits_to_keep=1)
    assert last.shape[1] == 1 and logits.shape[1] == x.shape[1] > 1
    torch.testing.assert_close(last[0, 0], logits[0, -1])
    torch.testing.assert_close(out1, out)
    assert last_cache.length == full_cache.length == x.shape[1]


def test_rows_with_their_own_caches_step_together_as_each_steps_alone(tiny_target, sequences):
    """``layer_step_rows``: rows whose caches hold different lengths, each with its own number of new entries (a
    prompt's feed, a verify pass's accepted rows, one chain token), laid one after another, give each row the outputs
    and the cache that ``layer_step`` gives it alone."""
    head = random_head(tiny_target, seed=4)
    ids = [torch.tensor(sequences[i]["input_ids"]) for i in (0, 1, 2)]
    cached, counts = [5, 11, 8], [3, 1, 2]
    alone, together = [KVCache() for _ in ids], [KVCache() for _ in ids]
    with torch.inference_mode():
        aux = [head.fc(features(tiny_target, x)) for x in ids]
        for caches in (alone, together):  # the same cached entries for both
            for c, x, a, n in zip(caches, ids, aux, cached):
                head.layer_step(a[None, :n], x[None, 1 : n + 1], c)
        want = [head.layer_step(a[None, n : n + m], x[None, n + 1 : n + 1 + m], c)
                for c, x, a, n, m in zip(alone, ids, aux, cached, counts)]
        got = head.layer_step_rows(torch.cat([a[None, n : n + m] for a, n, m in zip(aux, cached, counts)], dim=1),
                                   torch.cat([x[n + 1 : n + 1 + m] for x, n, m in zip(ids, cached, counts)])[None],
                                   together, counts)
    # one matrix product over all entries rounds differently from one per row: float32 noise of these large weights
    torch.testing.assert_close(got, torch.cat(want, dim=1), atol=1e-4, rtol=1e-4)
    for a, b, n, m in zip(alone, together, cached, counts):
        assert a.length == b.length == n + m
        torch.testing.assert_close(a.k[:, :, : a.length], b.k[:, :, : b.length], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(a.v[:, :, : a.length], b.v[:, :, : b.length], atol=1e-4, rtol=1e-4)


def test_profile_prices_a_feature_drafters_feed_once_per_proposal(tiny_target):
    """The profiler times a feature head as the decoder runs it (a feed of the committed rows, then the chain), so its
    cost has a per-token part and a per-proposal part, each a line over the profiled contexts with knot intervals;
    the drafter is left usable (a proposal after profiling works)."""
    from sacpolicy.profiling import profile

    drafter = FeatureDrafter(random_head(tiny_target, aux=AUX))
    cost = profile(tiny_target.model, [drafter], ks=(0, 1, 4), context_lens=(16, 48), repeats=5, warmup=1)
    assert set(cost.draft_fixed) == {drafter.name} and cost.per_token_draft[drafter.name]
    for curve in (cost.draft_fixed[drafter.name], cost.draft[drafter.name]):
        assert curve.xs == [16.0, 48.0] and all(lo <= hi for lo, hi in zip(curve.lo, curve.hi))
    once = max(0.0, cost.draft_fixed[drafter.name](32))
    assert cost.draft_time(drafter.name, 3, 32) == pytest.approx(once + 3 * cost.draft[drafter.name](33))
    ids = torch.randint(3, 512, (10,))
    state = drafter.new_state()
    drafter.extend_features(state, features(tiny_target, ids)[:9])
    assert propose_one(drafter, ids, 3, state=state).k == 3


def test_profile_prices_rows_of_a_feature_drafter_drafting_together(tiny_target):
    """With batch sizes, the profiler times the head's proposals for that many rows drafting together
    (one ``propose`` call) and keeps each row's share of one row's time (``draft_batch``: 1 at one row, a knot with its
    interval per profiled size), which the cost model applies to the head's draft time; the n-gram drafter gets none."""
    from sacpolicy.decoding import NgramDrafter
    from sacpolicy.profiling import profile

    drafter = FeatureDrafter(random_head(tiny_target, aux=AUX))
    cost = profile(tiny_target.model, [drafter, NgramDrafter()], ks=(0, 2), context_lens=(16, 32), repeats=3,
                   warmup=1, batch_sizes=(1, 2, 4))
    share = cost.draft_batch[drafter.name]
    assert set(cost.draft_batch) == {drafter.name}
    assert share.xs == [1.0, 2.0, 4.0] and share.ys[0] == 1.0 and min(share.ys) > 0
    assert all(lo <= hi for lo, hi in zip(share.lo, share.hi))
    one = cost.draft_time(drafter.name, 2, 24)
    assert cost.draft_time(drafter.name, 2, 24, rows=4) == pytest.approx(share.ys[2] * one)
    ids = torch.randint(3, 512, (10,))
    state = drafter.new_state()
    drafter.extend_features(state, features(tiny_target, ids)[:9])
    assert propose_one(drafter, ids, 2, state=state).k == 2


def test_teacher_force_equals_proposals(tiny_target, sequences):
    """One greedy ttt pass gives, at every position, the chain the drafter proposes position by position."""
    drafter = FeatureDrafter(random_head(tiny_target, seed=1))
    ids = torch.tensor(sequences[2]["input_ids"])
    aux = features(tiny_target, ids)
    fast = drafter.teacher_force(ids, 6, 5, aux)
    slow = propose_each(drafter, ids, 6, 5, aux)  # what a drafter without its own pass gets: propose() at each position
    assert fast.chained and fast.tokens.shape == (ids.numel() - 6, 5)
    assert torch.equal(fast.tokens, slow.tokens)
    for g in (0, 7, ids.numel() - 7):
        state = drafter.new_state()
        drafter.extend_features(state, aux[: 6 + g - 1])
        block = propose_one(drafter, ids[: 6 + g], 5, state=state)
        torch.testing.assert_close(fast.logits[g], block.logits[0], atol=2e-5, rtol=1e-5)
        assert torch.isinf(block.logits[0][~drafter.head.t2d]).all()  # q = 0 outside the draft vocabulary
    with pytest.raises(ValueError, match="needs aux"):
        drafter.teacher_force(ids, 6, 5)


def test_drafter_state_across_steps(tiny_target, sequences):
    """After propose / accept / extend_features, a proposal equals a fresh drafter's at the same context."""
    ids = torch.tensor(sequences[3]["input_ids"])
    aux = features(tiny_target, ids)
    drafter = FeatureDrafter(random_head(tiny_target, seed=2))
    state = drafter.new_state()
    n = 6
    drafter.extend_features(state, aux[: n - 1])
    sampling = SamplingConfig(temperature=1.0)
    for accepted in (2, 0, 3, 1):
        propose_one(drafter, ids[:n], 4, sampling, torch.Generator().manual_seed(n), state=state)
        drafter.accept(state, accepted)
        drafter.extend_features(state, aux[n - 1 : n + accepted])  # the verify pass: last token + accepted drafts
        n += accepted + 1
        fresh = drafter.new_state()
        drafter.extend_features(fresh, aux[: n - 1])
        a = propose_one(drafter, ids[:n], 3, state=state)
        b = propose_one(drafter, ids[:n], 3, state=fresh)
        assert torch.equal(a.tokens, b.tokens)
        torch.testing.assert_close(a.logits, b.logits, atol=2e-5, rtol=1e-5)
    stops = []
    block = propose_one(drafter, ids[:n], 4, stop=lambda i, s: stops.append(s) or i == 1, state=state)
    assert block.k == 2 and len(stops) == 2 and stops[0].shape == (3,)
    with pytest.raises(ValueError, match="extend_features"):
        propose_one(drafter, ids[: n + 1], 2, state=state)


def test_rows_drafted_together_propose_what_each_proposes_alone(tiny_target, sequences):
    """``propose`` of several rows: rows with their own contexts, k and stops (one at k = 0, one stopped after its first
    token) draft what each drafts alone, the draft logits from one projection over the rows still drafting (and
    over the rows whose features were fed, all rows' entries through the layer at once); and each row's state
    afterwards is its own (its next proposal equals a fresh drafter's)."""
    head = random_head(tiny_target, seed=3)
    proto = FeatureDrafter(head)
    ids = [torch.tensor(sequences[i]["input_ids"]) for i in (4, 5, 6, 7)]
    aux = [features(tiny_target, x) for x in ids]
    ns, ks = [7, 12, 9, 15], [4, 3, 5, 0]
    stops = [None, None, lambda i, s: i == 0, None]

    def states():
        out = [proto.new_state() for _ in ids]
        for st, a, n in zip(out, aux, ns):
            proto.extend_features(st, a[: n - 1])
        return out
    alone = [propose_one(proto, x[:n], k, stop=stop, state=st)
             for st, x, n, k, stop in zip(states(), ids, ns, ks, stops)]
    widths = []
    hook = head.lm_head.register_forward_pre_hook(lambda m, a: widths.append(a[0].numel() // a[0].shape[-1]))
    together_states = states()
    together = proto.propose([DraftRow(st, x[:n], k, stop=stop)
                              for st, x, n, k, stop in zip(together_states, ids, ns, ks, stops)])
    hook.remove()
    assert [b.k for b in together] == [b.k for b in alone] == [4, 3, 1, 0]
    for a, b in zip(alone, together):
        assert torch.equal(a.tokens, b.tokens)
        if a.k:
            torch.testing.assert_close(a.logits, b.logits, atol=2e-5, rtol=1e-5)
    assert widths[0] == 3  # the three proposing rows' features fed, their last outputs through one projection
    assert 2 in widths  # rows 0 and 1 drafted their later tokens through one projection
    for st, x, a, n in zip(together_states, ids, aux, ns):  # accept 1, feed the verify pass, propose again
        proto.accept(st, 1)
        proto.extend_features(st, a[n - 1 : n + 1])
        fresh = proto.new_state()
        proto.extend_features(fresh, a[: n + 1])
        assert torch.equal(propose_one(proto, x[: n + 2], 3, state=st).tokens,
                           propose_one(proto, x[: n + 2], 3, state=fresh).tokens)
    with pytest.raises(ValueError, match="row 1 holds hidden states"):
        proto.propose([DraftRow(st, x, 2) for st, x in zip(states(), [ids[0][:7], ids[1][:13]])])


def test_a_drafted_tokens_confidence_is_its_distribution_over_the_target_vocabulary(tiny_target, sequences):
    """The rows' draft logits are read over the draft vocabulary (the head's trimmed one): each token is the argmax of
    the block's full-vocabulary logits, and the confidence a stop callback gets is ``draft_stats`` of them (q = 0
    outside the draft vocabulary); a sampled token is one the draft can propose, drawn from q made over the draft
    vocabulary, which the block hands to verification: the processed distribution of its full-vocabulary logits,
    with its confidence."""
    from sacpolicy.decoding.sampling import draft_stats, probs_from_logits

    head = random_head(tiny_target, seed=4)
    assert head.config.draft_vocab_size < head.config.target_vocab_size
    proto = FeatureDrafter(head)
    ids = [torch.tensor(sequences[i]["input_ids"])[:n] for i, n in ((8, 9), (9, 14))]
    seen = [[], []]
    states = [proto.new_state() for _ in ids]
    for st, x in zip(states, ids):
        proto.extend_features(st, features(tiny_target, x)[: x.numel() - 1])
    stops = [lambda i, s, r=r: seen[r].append(s.clone()) is not None for r in range(2)]  # never stops
    blocks = proto.propose([DraftRow(st, x, k, stop=stop) for st, x, k, stop in zip(states, ids, [3, 4], stops)])
    for b, stats in zip(blocks, seen):
        assert b.logits.shape == (b.k, head.config.target_vocab_size)
        assert torch.equal(b.tokens, b.logits.argmax(-1))
        # asked after every token but the last (the block ends there anyway)
        torch.testing.assert_close(torch.stack(stats), draft_stats(b.logits[:-1]), atol=1e-6, rtol=1e-5)
    st = proto.new_state()
    proto.extend_features(st, features(tiny_target, ids[1])[: ids[1].numel() - 1])
    cfg = SamplingConfig(temperature=0.7, top_p=0.9)
    sampled = propose_one(proto, ids[1], 4, cfg, torch.Generator().manual_seed(0), state=st)
    assert sampled.k == 4 and bool(head.t2d[sampled.tokens].all())
    assert sampled.probs.shape == (4, head.config.target_vocab_size)
    torch.testing.assert_close(sampled.probs, probs_from_logits(sampled.logits, cfg), atol=1e-6, rtol=1e-5)
    assert bool((sampled.probs.gather(-1, sampled.tokens.view(-1, 1)) > 0).all())
    torch.testing.assert_close(sampled.confidence, draft_stats(sampled.logits), atol=1e-6, rtol=1e-5)
    greedy = proto.new_state()
    proto.extend_features(greedy, features(tiny_target, ids[1])[: ids[1].numel() - 1])
    assert propose_one(proto, ids[1], 2, state=greedy).probs is None  # greedy: the decoder needs no q


def trainer(tmp, **kw):
    return functools.partial(L.Trainer, accelerator="cpu", devices=1, enable_progress_bar=False, max_epochs=1000,
                             default_root_dir=str(tmp), enable_model_summary=False, num_sanity_val_steps=-1, **kw)


class Recorder(L.Callback):
    def __init__(self):
        self.accept, self.loss = [], []

    def on_validation_end(self, trainer, module):
        self.accept.append(float(trainer.callback_metrics["val/accept_len"]))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.loss.append(float(outputs["loss"]))


def test_training_lowers_loss_and_raises_acceptance(tiny_target, sequences, tmp_path):
    s = Eagle3Settings(draft_vocab_size=448, steps=3, lr=1e-3, max_steps=50, budget_minutes=None, patience=1000,
                       warmup_steps=5, batch_size=8, aux_layer_ids=AUX)
    rec = Recorder()
    train, val = sequences[:48], sequences[48:]
    m = train_eagle3(tiny_target, train, val, s, trainer(tmp_path), tmp_path, callbacks=[rec], progress=False)
    assert m["global_step"] == 50
    first, last = sum(rec.loss[:5]) / 5, sum(rec.loss[-5:]) / 5
    assert last < 0.5 * first, (first, last)
    # rec.accept[0]: the initial head (the sanity check runs the whole validation set)
    assert rec.accept[0] < 0.2 and m["val/accept_len"] > rec.accept[0] + 0.3, rec.accept
    drafter = load_feature_drafter(tiny_target, tmp_path / "head")
    provenance = json.loads((tmp_path / "head" / "provenance.json").read_text())
    assert provenance["metrics"]["val/accept_len"] == m["val/accept_len"]
    assert drafter.aux_layers == tuple(AUX) and drafter.head.config.draft_vocab_size == 448
    # the saved head is the best one: its greedy chains agree with the target as validation measured
    ids = torch.tensor(val[0]["input_ids"])
    tf = drafter.teacher_force(ids, 6, 3, features(tiny_target, ids))
    assert (tf.tokens[:-1, 0] == ids[7:]).float().mean() > 0.3
    # resume: a larger budget continues from last.ckpt
    s2 = Eagle3Settings(**{**s.__dict__, "max_steps": 53})
    assert train_eagle3(tiny_target, train, val, s2, trainer(tmp_path), tmp_path, progress=False)["global_step"] == 53


def test_save_load_round_trip(tiny_target, sequences, tmp_path):
    head = random_head(tiny_target, seed=3)
    save_head(head, tmp_path / "head", {"note": "test"})
    names = set(load_file(str(tmp_path / "head" / "model.safetensors")))
    assert names == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
        f"layers.0.{n}.weight" for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                          "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
                                          "hidden_norm", "post_attention_layernorm")}
    loaded = load_head(tmp_path / "head", tiny_target.model.get_input_embeddings())
    assert loaded.config == head.config
    assert torch.equal(loaded.draft_ids, head.draft_ids)  # rebuilt from the d2t offsets
    ids = torch.tensor(sequences[4]["input_ids"])
    aux = features(tiny_target, ids)
    a = FeatureDrafter(head).teacher_force(ids, 6, 3, aux)
    b = load_feature_drafter(tiny_target, tmp_path / "head").teacher_force(ids, 6, 3, aux)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logits, b.logits)


def test_bad_inputs_fail_clearly(tiny_target, sequences, tmp_path):
    cfg = tiny_target.model.config
    with pytest.raises(ValueError, match=r"aux_layer_ids \[0, 1, 4\] must be distinct layer ids in \[0, 3\]"):
        Eagle3Config.from_target(cfg, 100, aux_layer_ids=[0, 1, 4])
    with pytest.raises(ValueError, match="default aux_layer_ids"):  # [2, 2, 1] on a 4-layer target
        Eagle3Config.from_target(cfg, 100)
    with pytest.raises(ValueError, match=r"draft_vocab_size must be in \[1, 512\]"):
        Eagle3Config.from_target(cfg, 513, aux_layer_ids=AUX)
    # a head for another target
    from sacpolicy.models import load_model

    other = load_model("tiny:llama-1l", device="cpu", dtype="float32", seed=1)
    head = random_head(other, aux=[0])
    save_head(head, tmp_path / "other", {})
    with pytest.raises(ValueError, match="belongs to another target(.|\n)*verifier(.|\n)*decoder layers"):
        load_feature_drafter(tiny_target, tmp_path / "other")
    with pytest.raises(ValueError, match=r"feature rows must be \[m, 192\]"):
        FeatureDrafter(random_head(tiny_target)).extend_features(FeatureDrafter(random_head(tiny_target)).new_state(),
                                                                 torch.zeros(2, 64))
    with pytest.raises(FileNotFoundError, match="not an EAGLE-3 head directory"):
        load_feature_drafter(tiny_target, tmp_path)
    # a feature cache built for other layers, or other sequences
    build_feature_cache(tiny_target, sequences[:3], tmp_path / "feat", AUX, progress=False)
    with pytest.raises(ValueError, match=r"built for aux layer ids \[1, 2, 3\], not \[0, 2, 3\]"):
        build_feature_cache(tiny_target, sequences[:3], tmp_path / "feat", [0, 2, 3], progress=False)
    with pytest.raises(ValueError, match="built for sequences"):
        build_feature_cache(tiny_target, sequences[:4], tmp_path / "feat", AUX, progress=False)


def test_feature_cache_resumes(tiny_target, sequences, tmp_path):
    cache = build_feature_cache(tiny_target, sequences[:5], tmp_path, AUX, shard_size=2, progress=False)
    assert len(cache) == 5 and sorted(p.name for p in tmp_path.glob("shard-*")) == [
        "shard-00000.safetensors", "shard-00001.safetensors", "shard-00002.safetensors"]
    item = cache[3]
    ids = torch.tensor(sequences[3]["input_ids"])
    assert torch.equal(item["input_ids"], ids) and item["prompt_len"] == 6
    torch.testing.assert_close(item["aux"].float(), features(tiny_target, ids), atol=2e-2, rtol=2e-3)  # fp16
    (tmp_path / "shard-00001.safetensors").unlink()
    stamp = (tmp_path / "shard-00000.safetensors").stat().st_mtime_ns
    again = build_feature_cache(tiny_target, sequences[:5], tmp_path, AUX, shard_size=2, progress=False)
    assert (tmp_path / "shard-00000.safetensors").stat().st_mtime_ns == stamp  # kept, not recomputed
    assert torch.equal(again[3]["aux"], item["aux"])


def test_sglang_export_layout(tiny_target, tmp_path):
    head = random_head(tiny_target, seed=4)
    save_head(head, tmp_path / "head", {})
    export_sglang(tmp_path / "head", tmp_path / "sglang", dtype=torch.bfloat16)
    config = json.loads((tmp_path / "sglang" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 100
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # SGLang: output of layer i
    assert config["vocab_size"] == 512 and config["num_hidden_layers"] == 1 and not config["tie_word_embeddings"]
    tensors = load_file(str(tmp_path / "sglang" / "model.safetensors"))
    assert "midlayer.hidden_norm.weight" in tensors and not any(k.startswith("layers.") for k in tensors)
    assert tensors["midlayer.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert torch.equal(tensors["d2t"] + torch.arange(100), head.draft_ids)  # offsets, as SGLang reads them
    save_head(random_head(tiny_target, aux=[0, 2, 3]), tmp_path / "zero", {})
    with pytest.raises(ValueError, match="SGLang"):
        export_sglang(tmp_path / "zero", tmp_path / "bad")


def _speculators():
    if importlib.util.find_spec("speculators") is None:
        return None
    try:
        from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    except Exception as exc:  # installed but not importable with this transformers / torch
        pytest.skip(f"speculators is installed but its Eagle3DraftModel does not import here: {exc!r}")
    return Eagle3DraftModel, Eagle3SpeculatorConfig


@torch.no_grad()
def test_speculators_export_matches_the_real_package(tiny_target, sequences, tmp_path):
    found = _speculators()
    if found is None:
        pytest.skip("speculators is not installed (pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0 "
                    "openai jiter loguru==0.7.3)")
    Eagle3DraftModel, Eagle3SpeculatorConfig = found
    tiny_target.model.save_pretrained(tmp_path / "verifier")
    head = random_head(tiny_target, seed=5)
    save_head(head, tmp_path / "head", {})
    export_speculators(tmp_path / "head", tmp_path / "spec", str(tmp_path / "verifier"), num_speculative_tokens=3)
    config = Eagle3SpeculatorConfig.from_pretrained(tmp_path / "spec")
    assert config.speculators_config.proposal_methods[0].speculative_tokens == 3
    assert config.eagle_aux_hidden_state_layer_ids == AUX and config.draft_vocab_size == 100
    config.transformer_layer_config._attn_implementation = "eager"  # its default, flex attention, wants a GPU
    model = Eagle3DraftModel.from_pretrained(tmp_path / "spec", config=config).eval()
    assert torch.equal(model.d2t, head.d2t) and torch.equal(model.t2d, head.t2d)
    # with transformers newer than speculators pins (<= 5.19) from_pretrained initialises the missing embedding
    # instead of loading the verifier's; engines share the target's, so do the same here
    model.embed_tokens.weight.copy_(tiny_target.model.get_input_embeddings().weight)
    ids = torch.tensor(sequences[5]["input_ids"])
    T = ids.numel() - 1
    x, a = ids[1:].view(1, T), features(tiny_target, ids)[:T].unsqueeze(0)
    from test_byo_heads import speculators_logits

    theirs = speculators_logits(model, x, a, 3)
    ours = head.ttt_forward(x, a, 3)
    assert len(theirs) == 3
    for j in range(3):
        torch.testing.assert_close(theirs[j], ours[j], atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- losslessness through the real decoder loop
def test_decoder_with_a_feature_drafter_is_greedy_exact(tiny_target, sequences):
    """The decoder hands the head the target's hidden states; the greedy output is the target's own, for a head that
    agrees often (trained here briefly would be slow: a random head with a small vocabulary, and the self-consistent
    case of long accepted runs comes from the repetitive prompt)."""
    from sacpolicy.decoding import RequestInfo, SpeculativeDecoder
    from sacpolicy.policy import Heuristic, Static

    drafter = FeatureDrafter(random_head(tiny_target, vocab=200, seed=3))
    for row in sequences[:4]:
        prompt = row["input_ids"][:6]
        ref = tiny_target.model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 6, dtype=torch.long),
                                         max_new_tokens=20, do_sample=False, eos_token_id=None,
                                         pad_token_id=0)[0, 6:].tolist()
        for policy in (Static(1), Static(4), Heuristic(k0=3)):
            res = SpeculativeDecoder(tiny_target.model, [drafter], policy, stop_token_ids=[]).generate(
                prompt, 20, request=RequestInfo())
            assert res.tokens == ref, policy
            assert sum(s.drafted for s in res.steps) > 0 and not res.dropped_drafters


@pytest.mark.slow  # 2,500 draws a case (13-22 s each): make test runs them, the quick loop does not
@pytest.mark.parametrize("rows, fmt, cfg", [(1, "sacpolicy", SamplingConfig(temperature=1.0)),
                                             (5, "sacpolicy", SamplingConfig(temperature=1.0)),
                                             (1, "speculators", SamplingConfig(temperature=1.0)),
                                             (2, "sglang", SamplingConfig(temperature=1.0)),
                                             (2, "sacpolicy", SamplingConfig(temperature=0.7, top_p=0.9))])
def test_decoder_with_a_feature_drafter_samples_the_targets_distribution(rows, fmt, cfg, tmp_path):
    """Sampled speculative decoding with a feature head reproduces the target's joint distribution of two tokens
    drawn after verification blocks (chi-square against the exact joint, enumerated from the target's processed
    distributions: temperature and top-p included), one request at a time and in batches of rows (each its own
    seed), whose draft logits come from one projection over the rows; also with the head written in vLLM's
    speculators format and in SGLang's layout, then loaded back."""
    from scipy.stats import chisquare
    from transformers import LlamaConfig, LlamaForCausalLM

    from sacpolicy.decoding import DecoderConfig, RequestInfo, SpeculativeDecoder
    from sacpolicy.decoding.sampling import probs_from_logits
    from sacpolicy.models import LoadedModel, load_tokenizer
    from sacpolicy.policy import Static

    v = 6
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=v, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                             num_attention_heads=4, num_key_value_heads=2, head_dim=8)).eval()
    with torch.no_grad():
        model.model.norm.weight.mul_(4)  # peaked enough that drafts get accepted, spread enough to test sampling
    target = LoadedModel(model, load_tokenizer("tiny:llama-4l"), spec="test:v6")
    head = random_head(target, vocab=4, seed=4, aux=(1, 2, 3))  # ids 1..4: q = 0 outside the draft vocabulary
    if fmt != "sacpolicy":
        from test_byo_heads import write_format

        head = load_feature_drafter(target, write_format(fmt, head, target, tmp_path)).head
    dec = SpeculativeDecoder(model, [FeatureDrafter(head)], Static(2), sampling=cfg,
                             config=DecoderConfig(timing=False, max_batch=rows), stop_token_ids=[])
    widths = []
    hook = head.lm_head.register_forward_pre_hook(lambda m, a: widths.append(a[0].numel() // a[0].shape[-1]))
    with torch.no_grad():
        def p(prefix):
            return probs_from_logits(model(torch.tensor([prefix])).logits[0, -1], cfg).double()
        prompt = [1, 2]
        p1 = p(prompt)
        expected = sum(p1[a] * torch.outer(p(prompt + [a]), torch.ones(v, dtype=torch.float64))
                       * torch.stack([p(prompt + [a, b]) for b in range(v)]) for a in range(v))
    draws = 2500
    counts = np.zeros((v, v))
    accepted = 0
    for i in range(0, draws, rows):
        for res in dec.generate_batch([prompt] * rows, 4, requests=[RequestInfo(seed=i + j) for j in range(rows)]):
            counts[res.tokens[1], res.tokens[2]] += 1  # tokens 2 and 3: drafted together (k = 2), verified
            accepted += sum(s.accepted for s in res.steps)
    hook.remove()
    assert 0.05 * draws < accepted < 0.95 * draws  # both branches of verification were exercised
    assert max(widths) == rows  # batched: the rows' draft logits came from one projection
    expected = expected.numpy().ravel()
    possible = expected > 0  # top-p leaves some pairs impossible: never drawn, and out of the test
    assert counts.ravel()[~possible].sum() == 0
    _, pval = chisquare(counts.ravel()[possible], expected[possible] / expected.sum() * draws)
    assert pval > 1e-3, pval


def test_lr_schedule_warms_up_then_stays_or_decays_to_zero():
    from sacpolicy.training.common import lr_factor

    assert [lr_factor(s, 4) for s in (0, 3, 4, 1000)] == [0.25, 1.0, 1.0, 1.0]
    decayed = [lr_factor(s, 4, decay_steps=10) for s in range(4, 16)]
    assert decayed[0] == 1.0 and decayed[5] == pytest.approx(0.5) and decayed[10] == pytest.approx(0.0, abs=1e-12)
    assert all(a >= b for a, b in zip(decayed, decayed[1:])) and decayed[-1] == pytest.approx(0.0, abs=1e-12)


def test_hidden_states_beyond_float16_need_a_bfloat16_cache_and_the_error_names_the_setting(tiny_target, sequences,
                                                                                            tmp_path, monkeypatch):
    """Gemma's hidden states reach beyond float16's 65504: such a cache is refused naming ``head.cache_dtype``, and a
    bfloat16 cache holds them (finite, within bfloat16's rounding)."""
    from sacpolicy.training import eagle3_data

    real = eagle3_data.sequence_features

    def loud(*args, **kwargs):  # the tiny target's states scaled past float16's range, as Gemma's are
        for seq in real(*args, **kwargs):
            yield {**seq, "aux": seq["aux"].float() * 1e7}

    monkeypatch.setattr(eagle3_data, "sequence_features", loud)
    with pytest.raises(ValueError, match=r"overflow torch.float16.*head.cache_dtype=bfloat16"):
        build_feature_cache(tiny_target, sequences[:2], tmp_path / "f16", AUX, progress=False)
    cache = build_feature_cache(tiny_target, sequences[:2], tmp_path / "bf16", AUX, dtype=torch.bfloat16,
                                progress=False)
    ids = torch.tensor(sequences[1]["input_ids"])
    assert cache[1]["aux"].dtype == torch.bfloat16 and torch.isfinite(cache[1]["aux"].float()).all()
    torch.testing.assert_close(cache[1]["aux"].float(), features(tiny_target, ids) * 1e7, rtol=1e-2, atol=1e5)
    with pytest.raises(ValueError, match="head.cache_dtype='float8'"):
        Eagle3Settings(cache_dtype="float8")

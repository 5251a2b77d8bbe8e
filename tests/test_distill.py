"""Draft distillation: the divergences, trimmed vocabularies that keep decoding exact, export, resume, DDP."""

import functools
import json

import lightning as L
import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from toys import Markov

from sacpolicy.build import model_drafter
from sacpolicy.data import load_prompts
from sacpolicy.decoding import (
    ModelDrafter,
    RequestInfo,
    SamplingConfig,
    SpeculativeDecoder,
)
from sacpolicy.decoding.drafters import trim_lm_head
from sacpolicy.policy import Heuristic, Static
from sacpolicy.training.common import StepAcceptance
from sacpolicy.training.distill import (
    DistillModule,
    DistillSettings,
    _ahead,
    divergence,
    teacher_logp,
    train_draft,
)
from sacpolicy.training.distill_data import DistillDataModule, collate
from sacpolicy.training.drafts import build_draft, select_vocab



def logp(rows):
    return torch.log(torch.tensor(rows, dtype=torch.float32))


def test_divergences():
    p = logp([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
    q = logp([[0.5, 0.25, 0.25], [0.3, 0.3, 0.4]])
    for kind in ("fkl", "rkl", "jsd", "tvd"):
        assert torch.allclose(divergence(kind, p, p), torch.zeros(2), atol=1e-6)
        assert torch.all(divergence(kind, p, q) > 0)
    P, Q = p.exp(), q.exp()
    torch.testing.assert_close(divergence("fkl", p, q), (P * (p - q)).sum(-1))
    torch.testing.assert_close(divergence("rkl", p, q), (Q * (q - p)).sum(-1))
    torch.testing.assert_close(divergence("tvd", p, q), 1 - torch.minimum(P, Q).sum(-1))  # 1 - acceptance
    torch.testing.assert_close(divergence("jsd", p, q), divergence("jsd", q, p))  # symmetric at beta = 0.5
    torch.testing.assert_close(divergence("jsd", p, q, beta=1.0), divergence("fkl", p, q))
    with pytest.raises(ValueError, match="unknown distillation loss"):
        divergence("l2", p, q)


def test_teacher_projection_onto_a_trimmed_vocabulary():
    full = 10
    d2t = torch.tensor([1, 3, 4, 7])
    t2d = torch.full((full,), -1)
    t2d[d2t] = torch.arange(4)
    ids = torch.tensor([[3, 9, 1]])  # token 9 is outside the draft vocabulary
    lp = logp([[0.6, 0.3, 0.05]])
    out = teacher_logp(ids, lp, t2d, 4, full).exp()[0]
    assert out.sum().item() == pytest.approx(1.0, abs=1e-6)
    tail = 0.05 / 7
    expected = torch.tensor([0.05, 0.6, tail, tail])
    torch.testing.assert_close(out, expected / expected.sum())


def test_select_vocab_keeps_the_most_frequent_and_eos():
    counts = torch.tensor([5, 0, 9, 1, 7, 0])
    assert select_vocab(counts, 3, always=[5]).tolist() == [2, 4, 5]
    with pytest.raises(ValueError, match="trimmed vocabulary size"):
        select_vocab(counts, 0)


def test_trimmed_draft_stays_lossless(tiny_target):
    target = tiny_target.model
    prompts = load_prompts("mt_bench", tokenizer=tiny_target.tokenizer, limit=3)
    ref0 = target.generate(torch.tensor([prompts[0]["input_ids"]]), max_new_tokens=20, do_sample=False)[0].tolist()
    # a vocabulary that contains some of the target's greedy tokens and misses others
    d2t = torch.tensor(sorted(set(ref0[-20:][::2]) | set(range(100, 400))))
    for row in prompts:
        ids = row["input_ids"]
        ref = target.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)[0, len(ids):].tolist()
        draft = build_draft(tiny_target, arch="truncate", num_layers=4, vocab_size=None).model.eval()
        drafter = ModelDrafter(trim_lm_head(draft, d2t), name="trim", d2t=d2t, vocab_size=49152)
        res = SpeculativeDecoder(target, [drafter], Static(4), stop_token_ids=[]).generate(ids, 20)
        assert res.tokens == ref
        assert res.acceptance_rate > 0  # proposals are mapped back to target ids, so some match
    with pytest.raises(ValueError, match="vocab map"):
        ModelDrafter(trim_lm_head(build_draft(tiny_target, num_layers=1, vocab_size=None).model, d2t), d2t=d2t[:5],
                     vocab_size=49152)


@pytest.mark.slow  # chi-square over 5 s; make test runs it
def test_sampling_with_a_trimmed_draft_matches_the_target():
    v, d2t = 6, torch.tensor([0, 2, 3, 5])
    g = torch.Generator().manual_seed(11)
    P = torch.rand(v, v, generator=g) + 0.05
    P = P / P.sum(-1, keepdim=True)
    Qt = torch.rand(v, 4, generator=g) + 0.05  # the draft only knows 4 of the 6 tokens
    Qt = Qt / Qt.sum(-1, keepdim=True)
    dec = SpeculativeDecoder(Markov(P.log()), [ModelDrafter(Markov(Qt.log()), name="q", d2t=d2t, vocab_size=v)],
                             Heuristic(k0=2), sampling=SamplingConfig(temperature=1.0), stop_token_ids=[])
    draws, counts = 6000, np.zeros((v, v))
    for i in range(draws):
        toks = dec.generate([0], 3, request=RequestInfo(seed=i)).tokens
        counts[toks[1], toks[2]] += 1
    expected = ((P[0] @ P)[:, None] * P).double().numpy().ravel()
    _, pval = chisquare(counts.ravel(), expected / expected.sum() * draws)
    assert pval > 1e-3


@pytest.fixture(scope="module")
def tiny_data(tiny_target, tmp_path_factory):
    """Distillation data generated into a cache of the module's own, so that no test here reads data generated by an
    earlier run; converted models still come from the shared cache (else the worker's later loads would convert the
    embedded tokenizer again, ~18 s)."""
    from sacpolicy.models import cache_root

    cache, models = tmp_path_factory.mktemp("cache"), cache_root() / "models"
    models.mkdir(parents=True, exist_ok=True)
    (cache / "models").symlink_to(models, target_is_directory=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SACPOLICY_CACHE", str(cache))
        ps = load_prompts("mt_bench", tokenizer=tiny_target.tokenizer, limit=6)
        dm = DistillDataModule(tiny_target, ps.select(range(4)), ps.select(range(4, 6)), max_new_tokens=10,
                               samples=1, temperature=0.8, topk=16, batch_size=4, synthetic={"count": 0})
        dm.prepare_data()
        yield dm


def test_distillation_data(tiny_target, tiny_data):
    train, val = tiny_data.train, tiny_data.val
    assert len(train) == 8 and len(val) == 2  # greedy + one sample per prompt; greedy only for val
    row = train[0]
    cont = len(row["input_ids"]) - row["prompt_len"]
    assert len(row["topk_ids"]) == cont and len(row["topk_ids"][0]) == 16
    # the greedy continuation's tokens are the teacher's top-1 at each position
    greedy = [r for r in train if r["sample"] == 0 and r["prompt_id"] == val[0]["prompt_id"]] or list(val)
    r = greedy[0]
    assert [t[0] for t in r["topk_ids"]] == r["input_ids"][r["prompt_len"]:]
    b = collate([train[0], train[1]])
    assert b["loss_mask"].sum().item() == sum(len(train[i]["input_ids"]) - train[i]["prompt_len"] for i in (0, 1))


def test_first_answers_are_generated_once_for_prompts_and_distillation(tiny_target, tmp_path, monkeypatch):
    import datasets

    from sacpolicy.training import distill_data

    monkeypatch.setenv("SACPOLICY_CACHE", str(tmp_path))
    calls, real = [], distill_data.generate_continuations
    monkeypatch.setattr(distill_data, "generate_continuations",
                        lambda target, prompts, **kw: calls.append(list(prompts["prompt_id"])) or real(target, prompts, **kw))
    answers = distill_data.first_answers(tiny_target, max_new_tokens=6, topk=8)
    assert len(answers) == 80 and len(calls) == 1  # every MT-Bench first turn, in one generation
    assert distill_data.first_answers(tiny_target, max_new_tokens=6, topk=8)["input_ids"] == answers["input_ids"]
    assert len(calls) == 1  # cached
    texts = distill_data.answer_texts(answers, tiny_target.tokenizer)
    assert sorted(texts) == sorted(answers["prompt_id"])
    chat = load_prompts("mt_bench", tokenizer=tiny_target.tokenizer, limit=6)
    code = load_prompts("humaneval", tokenizer=tiny_target.tokenizer, limit=2)
    calls.clear()
    dm = DistillDataModule(tiny_target, datasets.concatenate_datasets([chat.select(range(4)), code]),
                           chat.select(range(4, 6)), max_new_tokens=6, samples=0, topk=8, synthetic={"count": 0},
                           reuse=answers)
    dm.setup()
    assert calls == [list(code["prompt_id"])]  # only the prompts without a first answer are generated
    by_id = {r["prompt_id"]: r for r in answers}
    for row in list(dm.train) + list(dm.val):
        if row["prompt_id"].startswith("mt_bench/"):
            assert row == by_id[row["prompt_id"]]
    assert sorted(dm.train["prompt_id"]) == sorted(list(chat["prompt_id"])[:4] + list(code["prompt_id"]))


def trainer(tmp, **kw):
    return functools.partial(L.Trainer, accelerator="cpu", devices=1, enable_progress_bar=False, max_epochs=20,
                             default_root_dir=str(tmp), enable_model_summary=False, **kw)


def test_train_export_load_and_resume(tiny_target, tiny_data, tmp_path):
    s = DistillSettings(num_layers=1, vocab_size=512, max_steps=3, budget_minutes=None, val_check_interval=1.0,
                        warmup_steps=1, on_policy_fraction=0.5, on_policy_tokens=6)
    m1 = train_draft(tiny_target, tiny_data, s, trainer(tmp_path), tmp_path)
    assert m1["global_step"] == 3 and 0 <= m1["val/match_rate"] <= 1
    out = tmp_path / "draft"
    meta = json.loads((out / "sacpolicy_draft.json").read_text())
    assert meta["trimmed_vocab"] == 512 and meta["settings"]["loss"] == "fkl"
    from transformers import AutoModelForCausalLM

    hf_draft = AutoModelForCausalLM.from_pretrained(out)
    assert hf_draft.get_output_embeddings().out_features == 49152  # full head for transformers users
    ids = tiny_data.val[0]["input_ids"][: tiny_data.val[0]["prompt_len"]]
    x = torch.tensor([ids])
    ref = tiny_target.model.generate(x, max_new_tokens=12, do_sample=False)[0].tolist()
    assert tiny_target.model.generate(x, max_new_tokens=12, do_sample=False, assistant_model=hf_draft)[0].tolist() == ref
    drafter = model_drafter(tiny_target, str(out))
    assert drafter.d2t.numel() == 512 and drafter.vocab_size == 49152
    res = SpeculativeDecoder(tiny_target.model, [drafter], Static(3), stop_token_ids=[]).generate(ids, 12)
    assert res.tokens == ref[len(ids):]

    # resume: a larger budget continues from last.ckpt
    s2 = DistillSettings(**{**s.__dict__, "max_steps": 5})
    assert train_draft(tiny_target, tiny_data, s2, trainer(tmp_path), tmp_path)["global_step"] == 5
    # a checkpoint of another configuration is refused
    s3 = DistillSettings(**{**s.__dict__, "loss": "tvd", "max_steps": 7})
    with pytest.raises(ValueError, match="different configuration"):
        train_draft(tiny_target, tiny_data, s3, trainer(tmp_path), tmp_path)


def test_nan_loss_stops_with_step_and_batch(tiny_target, tiny_data):
    draft = build_draft(tiny_target, num_layers=1, vocab_size=None)
    module = DistillModule(draft, 49152, DistillSettings())
    batch = collate([tiny_data.train[0]])
    batch["topk_logp"][:] = float("nan")
    with pytest.raises(FloatingPointError, match="step 0 .batch 7."):
        module.training_step(batch, 7)


def test_held_out_acceptance_per_step_counts_chains_of_greedy_agreement():
    class Chains(StepAcceptance):
        acceptance_steps, device = 3, "cpu"

    chains = Chains()
    chains.on_validation_epoch_start()
    mask = torch.tensor([[False, True, True, True, True]])  # row 0 predicts a prompt token: no target there
    hit = torch.tensor([[False, True, True, False, True]])  # the draft's greedy token is the target's
    steps = range(3)
    chains.count_chains(mask, [_ahead(mask, j) for j in steps], [_ahead(hit, j) for j in steps])
    # chains start at rows 1-4; step 0 right from 1, 2, 4; step 1 (row + 1 must exist) from 1 and 2, right from 1;
    # step 2 from 1 only, wrong (row 3)
    assert chains._chains.tolist() == [[3, 4], [1, 2], [0, 1]]


def test_bad_settings():
    with pytest.raises(ValueError, match="unknown distillation loss"):
        DistillSettings(loss="mse")
    with pytest.raises(ValueError, match="unknown draft arch"):
        DistillSettings(arch="medusa")
    with pytest.raises(ValueError, match="budget"):
        DistillSettings(budget_minutes=None, max_steps=None)


def test_draft_with_another_tokenizer_is_refused(tiny_target, tiny_draft, tmp_path):
    import copy

    from sacpolicy.models import TokenizerMismatchError

    tok = copy.deepcopy(tiny_draft.tokenizer)
    tok.add_tokens(["<zzz_other_token>"])
    tiny_draft.model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    with pytest.raises(TokenizerMismatchError, match="zzz_other_token"):
        build_draft(tiny_target, arch="pretrained", spec=str(tmp_path))


def test_fixed_text_is_distilled_verbatim(tiny_target, tiny_data, tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("The quick brown fox jumps over the lazy dog.\nSpeculative decoding verifies drafts in one pass.\n")
    fixed = load_prompts(f"text:{path}", tokenizer=tiny_target.tokenizer, chat=False)
    dm = DistillDataModule(tiny_target, tiny_data.train_prompts, tiny_data.val_prompts, max_new_tokens=10, samples=1,
                           temperature=0.8, topk=16, batch_size=4, fixed_text=fixed, synthetic={"count": 0})
    dm.prepare_data()
    text_rows = [r for r in dm.train if r["prompt_len"] == 1]
    assert len(dm.train) == len(tiny_data.train) + 2 and len(text_rows) == 2
    row = text_rows[0]
    assert row["input_ids"] == fixed[0]["input_ids"] and len(row["topk_ids"]) == len(row["input_ids"]) - 1


def test_synthetic_prompts_are_requests_the_target_writes(tiny_target, monkeypatch):
    from sacpolicy.data import apply_template
    from sacpolicy.training import distill_data

    tok, eos = tiny_target.tokenizer, tiny_target.eos_token_ids[0]
    prefix = distill_data.user_turn_prefix(tok)
    templated = tok.apply_chat_template([{"role": "user", "content": "Hello there"}], tokenize=False)
    assert tok.decode(prefix) == templated.split("Hello there")[0]  # system prompt and user header, nothing more

    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    bread, rivers = ids("How do I bake bread?"), ids("Name three rivers in Europe.")
    width = 16
    sampled = [bread + [eos], bread + [eos], rivers + [eos, eos], ids("Hi") + [eos], (rivers * 4)[:width]]
    calls = []

    def fake_generate(input_ids, **kw):
        calls.append(kw)
        assert input_ids.tolist() == [prefix] * input_ids.shape[0]  # sampling starts at the user's turn
        rows = [r + [eos] * (width - len(r)) for r in sampled[: input_ids.shape[0]]]
        return torch.cat([input_ids, torch.tensor(rows)], 1)

    monkeypatch.setattr(tiny_target.model, "generate", fake_generate)
    ps = distill_data.synthetic_prompts(tiny_target, 5, max_tokens=width, progress=False)
    assert calls[0]["do_sample"] and calls[0]["max_new_tokens"] == width
    # a duplicate, a too-short request and an unfinished one are dropped
    assert [m[0]["content"] for m in ps["messages"]] == ["How do I bake bread?", "Name three rivers in Europe."]
    assert ps["prompt_id"] == ["synthetic/0", "synthetic/1"] and set(ps["category"]) == {"synthetic"}
    assert ps[1]["input_ids"] == apply_template(ps[1]["messages"], tok)


def test_synthetic_prompts_join_the_training_data(tiny_target, tiny_data, monkeypatch):
    from sacpolicy.training import distill_data

    own = tiny_data.val_prompts.map(lambda r, i: {"prompt_id": f"synthetic/{i}"}, with_indices=True)
    asked = []
    monkeypatch.setattr(distill_data, "synthetic_prompts", lambda target, count, **kw: asked.append(count) or own)
    dm = DistillDataModule(tiny_target, tiny_data.train_prompts, tiny_data.val_prompts, max_new_tokens=10, samples=1,
                           temperature=0.8, topk=16, batch_size=4, synthetic={"count": 2})
    dm.prepare_data()
    rows = [r for r in dm.train if r["prompt_id"].startswith("synthetic/")]
    assert asked == [2] and len(dm.train) == len(tiny_data.train) + 2 and len(rows) == 2
    for r in rows:  # greedy continuations: the teacher's top-1 is the token that follows
        assert [t[0] for t in r["topk_ids"]] == r["input_ids"][r["prompt_len"]:]
    with pytest.raises(ValueError, match="unknown distill.data.synthetic keys"):
        DistillDataModule(tiny_target, tiny_data.train_prompts, tiny_data.val_prompts, synthetic={"n": 2})


def test_a_pretrained_draft_of_another_vocabulary_size_is_refused_for_distillation(tiny_target, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    small = LlamaForCausalLM(LlamaConfig(**{**tiny_target.model.config.to_dict(), "vocab_size": 40_000,
                                            "num_hidden_layers": 1}))
    small.save_pretrained(tmp_path / "small")
    tiny_target.tokenizer.save_pretrained(tmp_path / "small")
    with pytest.raises(ValueError, match="scores 40000 token ids, the target 49152(.|\n)*Fix: decode with this draft"):
        build_draft(tiny_target, arch="pretrained", spec=str(tmp_path / "small"), vocab_size=None)


def test_continuations_cut_a_batch_to_fit_the_logits_budget_and_give_the_same_rows(tiny_target, monkeypatch, caplog):
    """A 262k vocabulary's raw logits for 48 rows and 160 tokens are 8 GB (Gemma 3 ran out of memory there): batches
    are cut to ``LOGITS_BUDGET``; the rows are the same as one batch gives (greedy, left padding either way)."""
    import datasets

    from sacpolicy.training import distill_data

    prompts = datasets.Dataset.from_dict({"prompt_id": [f"p{i}" for i in range(4)],
                                          "input_ids": [[5, 6, 7, 8, 9], [11, 12], [40, 41, 42], [7] * 7]})
    whole = distill_data.generate_continuations(tiny_target, prompts, max_new_tokens=6, batch_size=4, topk=4,
                                                progress=False)
    vocab = tiny_target.model.get_output_embeddings().out_features
    monkeypatch.setattr(distill_data, "LOGITS_BUDGET", 2 * 6 * vocab * 4)  # two rows' logits
    with caplog.at_level("INFO", logger=distill_data.__name__):
        cut = distill_data.generate_continuations(tiny_target, prompts, max_new_tokens=6, batch_size=4, topk=4,
                                                  progress=False)
    assert "batches of 2 rows, not 4" in caplog.text
    a, b = whole.to_dict(), cut.to_dict()
    assert a["prompt_id"] == b["prompt_id"] and a["input_ids"] == b["input_ids"] and a["topk_ids"] == b["topk_ids"]
    for x, y in zip(a["topk_logp"], b["topk_logp"]):
        assert torch.allclose(torch.tensor(x), torch.tensor(y), atol=2e-2)

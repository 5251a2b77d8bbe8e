"""Peers (``sacpolicy.policy.peers``): each engine's rule on hand-made states and records, replayed and decoded live
(lossless, one request and a batch), the replay of a learning peer equal to its live decisions step for step, bad
settings refused with the fix, and tuning on validation traces (``sacpolicy.traces.peer_tuning``)."""

import math
from types import SimpleNamespace

import pytest
import torch
from test_traces import cost_model
from toys import Markov, markov_pair, synthetic_traces

from sacpolicy.data import assign_split
from sacpolicy.decoding import (
    Autoregressive,
    Decision,
    DecodeState,
    DraftToken,
    ModelDrafter,
    NgramDrafter,
    PolicyRow,
    RequestInfo,
    SpeculativeDecoder,
    StepRecord,
)
from sacpolicy.policy import (
    AdaEDL,
    LlamaCppPMin,
    SglangAdaptive,
    TrtllmAdaptive,
    VllmAdaptiveVerification,
    VllmBatchSchedule,
)
from sacpolicy.policy.peers import (
    AcceptanceEstimator,
    SglangSlot,
    trtllm_draft_len,
    vllm_k_for_batch,
    vllm_schedule,
)
from sacpolicy.profiling import CostModel, PiecewiseLinear
from sacpolicy.traces.collect import collect_teacher_forced
from sacpolicy.traces.peer_tuning import PEERS, build_peer, peer_grid, tune_peer
from sacpolicy.traces.schema import load_traces
from sacpolicy.traces.simulate import group_traces, simulate

V = 1000  # the synthetic traces' vocabulary
N_NEW = 24


def state(batch: int = 1, remaining: int = 100, drafters=("d",)) -> DecodeState:
    return DecodeState(RequestInfo(prompt_len=10, drafters=drafters), context_len=50, remaining=remaining,
                       drafters=drafters, batch_size=batch)


def record(accepted: int, drafted: int, batch: int = 1, drafter: str | None = "d", top1=()) -> StepRecord:
    return StepRecord(step=0, drafter=drafter, k=drafted, drafted=drafted, accepted=accepted, emitted=accepted + 1,
                      context_len=50, draft_s=0.0, verify_s=0.0, batch_size=batch, top1=list(top1))


def engine_step(policy, memories, outcomes) -> list[Decision]:
    """One engine step of len(memories) rows: the policy decides them together, then observes each row's
    (accepted, drafted)."""
    rows = [PolicyRow(state(batch=len(memories)), m) for m in memories]
    decisions = policy.decide(rows)
    for row, (accepted, drafted) in zip(rows, outcomes):
        policy.observe(row, record(accepted, drafted, batch=len(rows)))
    return decisions


# ---------------------------------------------------------------------- SGLang
def test_sglang_slot_moves_between_tiers_with_hysteresis_after_warmup():
    settings = {"candidate_steps": [1, 3, 5, 7], "warmup_batches": 2, "update_interval": 1, "ema_alpha": 0.5}
    slot = SglangSlot.of({**settings, "down_hysteresis": -0.25}, initial_steps=3, where="test")
    plain = SglangSlot.of({**settings, "down_hysteresis": 0.0}, initial_steps=3, where="test")
    assert (slot.steps, slot.ema) == (3, 2.0)  # the EMA starts at steps - 1
    for _ in range(2):  # warmup: the EMA moves (2.5, 2.75), the steps do not
        assert not slot.update([3]) and not plain.update([3, 3])
    assert slot.steps == 3 and slot.ema == pytest.approx(2.75)
    assert slot.update([3]) and slot.steps == 5  # EMA 2.875 > 3 - 0.5: up one tier, not two (2.875 < 4.5)
    plain.update([3])
    assert plain.steps == 5
    # EMA 2.4375: at most 3 - 0.5 (down without hysteresis) but above 3 - 0.5 - 0.25: the hysteresis holds the tier
    slot.update([2])
    plain.update([2])
    assert (slot.steps, plain.steps) == (5, 3) and slot.ema == pytest.approx(2.4375)
    slot.update([2])  # EMA 2.21875 <= 2.25: down to 3; not to 1 (needs <= 0.25)
    assert slot.steps == 3
    for _ in range(3):  # zero accepted: 1.109, 0.555, 0.277 stay above 1 - 0.5 - 0.25; then 0.139 drops to 1
        slot.update([0])
        assert slot.steps == 3
    slot.update([0, 0])
    assert slot.steps == 1 and slot.ema == pytest.approx(0.138671875)


def test_sglang_slot_at_zero_steps_probes_the_next_tier_and_moves_every_interval():
    slot = SglangSlot.of({"candidate_steps": [0, 1, 3], "warmup_batches": 0, "update_interval": 1}, 0, "test")
    assert (slot.steps, slot.ema) == (0, -1.0)
    assert slot.update([0]) and (slot.steps, slot.ema) == (1, 0.0)  # no EMA move while at 0; the probe resets it
    assert SglangSlot.of({"candidate_steps": [0, 1]}, 3, "test").steps == 1  # 3 is no tier: the middle one
    every3 = SglangSlot.of({"candidate_steps": [1, 3], "warmup_batches": 1, "update_interval": 3, "ema_alpha": 1.0},
                           1, "test")
    moved = [every3.update([3]) for _ in range(5)]
    assert moved == [False, False, False, True, False] and every3.steps == 3  # batches 4, 7, ... after the warmup


def test_sglang_routes_each_batch_size_to_its_slot_and_folds_a_step_once():
    policy = SglangAdaptive()  # SGLang's default config: slots 1, 8, 32, 64
    policy.validate(("d",), 8)
    assert list(policy.slots) == [1, 8, 32, 64]
    assert all(policy.slot(b) is policy.slots[s] for b, s in ((1, 1), (7, 1), (8, 8), (31, 8), (32, 32), (999, 64)))
    assert [s.steps for s in policy.slots.values()] == [3, 3, 1, 0]  # initial 3, else each slot's middle tier
    assert engine_step(policy, [None] * 8, [(0, 3)] * 8) == [Decision("d", 3)] * 8
    assert engine_step(policy, [None] * 40, [(1, 1)] * 40) == [Decision("d", 1)] * 40
    assert engine_step(policy, [None] * 64, []) == [Decision.autoregressive()] * 64
    assert engine_step(policy, [None] * 2, [(3, 3), (1, 3)]) == [Decision("d", 3)] * 2
    slot = policy.slots[1]
    assert slot.batches == 0  # a step is folded in when the next one is decided
    policy.decide([PolicyRow(state(), None)])
    assert slot.batches == 1 and slot.ema == pytest.approx(2.0 + 0.2 * (2.0 - 2.0))
    assert policy.slots[8].batches == 1 and policy.slots[8].ema == pytest.approx(2.0 - 0.2 * 2.0)


# ---------------------------------------------------------------------- TensorRT-LLM
def test_trtllm_draft_len_by_batch_size_and_max_concurrency():
    schedule = {1: 4, 4: 2, 8: 0}
    assert [trtllm_draft_len(schedule, b) for b in (1, 2, 3, 4, 7, 8, 100)] == [4, 4, 4, 2, 2, 0, 0]
    policy = TrtllmAdaptive(4, {"1": 4, "4": 2, "8": 0}, max_concurrency=6)
    policy.validate(("d",), 8)
    assert [policy.draft_len(b) for b in (1, 3, 5, 6, 7)] == [4, 4, 2, 2, 0]
    assert engine_step(policy, [None] * 5, []) == [Decision("d", 2)] * 5
    assert engine_step(TrtllmAdaptive(3), [None] * 50, []) == [Decision("d", 3)] * 50  # no schedule: max_draft_len


def test_trtllm_gate_turns_speculation_off_below_the_threshold_and_keeps_it_off():
    policy = TrtllmAdaptive(4, acceptance_rate_window_size=3, acceptance_rate_threshold=0.5)
    seen = [engine_step(policy, [None], [(a, 4)])[0].k for a in (0, 0, 0, 4, 4)]
    assert seen == [4, 4, 4, 0, 0]  # the window fills after 3 steps at rate 0: off, and full acceptance won't undo it
    policy = TrtllmAdaptive(4, acceptance_rate_window_size=3, acceptance_rate_threshold=0.5)
    seen = [engine_step(policy, [None], [(a, 5)])[0].k for a in (3, 2, 3, 1, 5)]
    assert seen == [4, 4, 4, 4, 0]  # rolling means 0.533 then 0.4: off one step after the mean falls below
    # an iteration's rate pools the rows that drafted: (0 + 3) / (4 + 3) = 0.43 < 0.45, though the rows' mean is 0.5
    policy = TrtllmAdaptive(4, acceptance_rate_window_size=1, acceptance_rate_threshold=0.45)
    rows = [PolicyRow(state(batch=3), None) for _ in range(3)]
    policy.decide(rows)
    for row, rec in zip(rows, (record(0, 4, 3), record(3, 3, 3), record(0, 0, 3, drafter=None))):
        policy.observe(row, rec)
    assert policy.decide(rows) == [Decision.autoregressive()] * 3


def test_trtllm_request_scope_gates_each_request_alone():
    policy = TrtllmAdaptive(2, acceptance_rate_window_size=2, acceptance_rate_threshold=0.5, scope="request")
    bad, good = policy.start(RequestInfo()), policy.start(RequestInfo())
    for _ in range(2):
        engine_step(policy, [bad, good], [(0, 2), (2, 2)])
    assert engine_step(policy, [bad, good], []) == [Decision.autoregressive(), Decision("d", 2)]
    assert engine_step(policy, [policy.start(RequestInfo())], []) == [Decision("d", 2)]  # a new request starts on


# ---------------------------------------------------------------------- vLLM: k by batch size
def test_vllm_schedule_picks_k_by_vllms_lookup():
    schedule = vllm_schedule([[32, 128, 2], [1, 16, 3]])  # vLLM sorts the ranges
    assert schedule == [(1, 16, 3), (32, 128, 2)]
    ks = [vllm_k_for_batch(schedule, b, 4) for b in range(1, 201)]
    # in range 3, in the gap 17..31 the range before carries on, then 2, and past the last range it carries on too
    assert ks == [3] * 31 + [2] * 169
    capped = vllm_schedule([[1, 4, 8], [5, 8, 1]])
    assert [vllm_k_for_batch(capped, b, 4) for b in range(1, 11)] == [4] * 4 + [1] * 6  # never above 4
    policy = VllmBatchSchedule([[1, 4, 3], [5, 8, 0]])
    policy.validate(("d",), 8)
    assert engine_step(policy, [None] * 4, []) == [Decision("d", 3)] * 4
    assert engine_step(policy, [None] * 6, []) == [Decision.autoregressive()] * 6


def test_vllm_schedule_lookup_equals_vllms_own_table():
    utils = pytest.importorskip("vllm.v1.spec_decode.dynamic.utils")
    for entries, k in (([[1, 16, 3], [32, 128, 2]], 4), ([[1, 1, 5], [3, 6, 0], [7, 9, 2]], 3), ([[1, 64, 2]], 6)):
        table = utils.build_dynamic_sd_schedule_lookup(entries, 150, k)
        assert [vllm_k_for_batch(vllm_schedule(entries), b, k) for b in range(1, 151)] == table[1:]


# ---------------------------------------------------------------------- vLLM: adaptive verification
def _bounded(est: AcceptanceEstimator) -> bool:
    return (math.isfinite(est.slope) and 0.0 <= est.slope <= est.BOUND
            and all(math.isfinite(b) and abs(b) <= est.BOUND for b in est.intercepts))


@pytest.mark.parametrize("stream", ["all accepted", "none", "alternating", "extremes", "anti", "nan"])
def test_the_acceptance_estimator_moves_toward_the_labels_and_stays_finite(stream):
    est = AcceptanceEstimator(3, refit_interval=1)
    assert est.predict(0.0, 0) == pytest.approx(1 / (1 + math.exp(0.2)))  # cold start: slope 0.5, intercept -0.2
    for step in range(400):
        if stream in ("all accepted", "none", "alternating"):
            top1, label = 0.5, {"all accepted": True, "none": False, "alternating": step % 2 == 0}[stream]
        elif stream == "nan":
            top1, label = float("nan"), step % 3 == 0
        else:  # a sure draft accepted and a hopeless one rejected, or the reverse
            sure = step % 2 == 0
            top1, label = (1.0 if sure else 0.0), sure if stream == "extremes" else not sure
        f = est.feature(top1)
        for j in range(3 if label else 1):  # accepted: the chain goes on; rejected: the first position ends it
            est.observe(j, f, est.predict(f, j), label)
        est.end_step()
        assert _bounded(est), (step, est.slope, est.intercepts)
    p = est.predict(0.0, 0)
    if stream == "all accepted":
        assert p > 0.95
    elif stream == "none":
        assert p < 0.05
    elif stream == "alternating":
        assert p == pytest.approx(0.5, abs=0.05)
    elif stream == "extremes":
        assert est.predict(est.feature(1.0), 0) > 0.95
        assert est.predict(est.feature(0.0), 0) < 0.05
    elif stream == "anti":  # every slope step would turn it negative: vLLM drops such steps
        assert est.slope == est.INIT_SLOPE
        assert est.predict(est.feature(1.0), 0) >= est.predict(est.feature(0.0), 0)
    assert est.refits == 400


def _flat_cost(per_token: float = 0.005) -> CostModel:
    return CostModel(device="cpu", verify={"tokens": PiecewiseLinear([1, 9], [0.05, 0.05 + 8 * per_token]),
                                           "per_context": 0.0},
                     draft={"d": PiecewiseLinear([0], [0.0])}, per_token_draft={"d": True})


def test_vllm_adaptive_budget_admits_the_slots_that_pay_for_their_verification():
    policy = VllmAdaptiveVerification(_flat_cost(), num_speculative_tokens=4)
    policy.validate(("d",), 8)
    fresh = policy.start(RequestInfo())  # a new request's confidences are 1.0: every slot pays
    assert engine_step(policy, [fresh], []) == [Decision("d", 4)]
    unsure = policy.start(RequestInfo())
    unsure.confidence = [0.2] * 4  # B = 0: 1 / 0.05 = 20; B = 1: 1.2 / 0.055 = 21.8; B = 2: 1.24 / 0.06 = 20.7
    assert engine_step(policy, [unsure], []) == [Decision("d", 1)]
    unsure.confidence = [0.05] * 4
    assert engine_step(policy, [unsure], []) == [Decision.autoregressive()]
    # rows together: the batch's best slots by survival, the sure row's first (0.5, 0.25 beat the unsure row's 0.1;
    # a third sure slot, 0.125, costs a longer pass than it brings)
    sure = policy.start(RequestInfo())
    sure.confidence, unsure.confidence = [0.5] * 4, [0.1] * 4
    assert engine_step(policy, [unsure, sure], []) == [Decision.autoregressive(), Decision("d", 2)]
    sure.confidence = [0.99] * 4
    near_end = PolicyRow(state(remaining=3), sure)
    assert policy.decide([near_end]) == [Decision("d", 2)]  # never more than the row's room


def test_vllm_adaptive_learns_up_to_the_first_rejection_and_estimates_the_rest():
    policy = VllmAdaptiveVerification(_flat_cost(), num_speculative_tokens=4, refit_interval=1)
    row = PolicyRow(state(), policy.start(RequestInfo()))
    assert policy.decide([row]) == [Decision("d", 4)]
    est = policy.estimator
    for j, top1 in enumerate((0.9, 0.8, 0.3)):  # the decoder asks after every token but the block's last
        assert policy.should_stop(row, DraftToken(j, top1, 0.5, 0.1)) is False  # it only records
    policy.observe(row, record(accepted=1, drafted=4))  # position 0 accepted, 1 rejected; 2 and 3 drafted after it
    assert [s[5] for s in est.stats] == [1.0, 1.0, 0.0, 0.0]
    assert est.stats[0][4] == pytest.approx(1 - row.memory.predictions[0])  # label 1 minus the draft-time prediction
    assert est.stats[1][4] == pytest.approx(-row.memory.predictions[1])
    f1 = est.feature(0.8)
    assert row.memory.confidence == pytest.approx([row.memory.predictions[0], row.memory.predictions[1],
                                                   est.predict(f1, 2), est.predict(f1, 3)])
    policy.decide([row])  # the step is over: the estimator refits (interval 1) and clears the round
    assert est.refits == 1 and est.stats[0][5] == 0.0 and est.intercepts[0] != est.INIT_BIAS
    # with the step's statistics the block's last token counts too
    policy.observe(row, record(accepted=4, drafted=4, top1=(0.9, 0.9, 0.9, 0.9)))
    assert [s[5] for s in est.stats] == [1.0, 1.0, 1.0, 1.0]


# ---------------------------------------------------------------------- llama.cpp, AdaEDL
def test_llamacpp_stops_after_the_first_token_below_p_min():
    policy = LlamaCppPMin(p_min=0.75, draft_max=8)
    row = PolicyRow(state(), None)
    assert engine_step(policy, [None], []) == [Decision("d", 8)]
    assert [policy.should_stop(row, DraftToken(j, p, 0.0, 0.0)) for j, p in enumerate((0.9, 0.75, 0.74))] == \
        [False, False, True]
    patient = LlamaCppPMin(p_min=0.75, draft_max=8, draft_min=2)
    assert [patient.should_stop(row, DraftToken(j, 0.1, 0.0, 0.0)) for j in range(3)] == [False, True, True]


def test_adaedl_stops_when_the_entropy_bound_falls_below_the_threshold():
    policy = AdaEDL(gamma=0.25, threshold=0.5, k=6)
    row = PolicyRow(state(), None)
    assert policy.bound(0.0) == 1.0 and policy.bound(1.0) == pytest.approx(0.5)  # 1 - sqrt(0.25 * 1)
    stops = [policy.should_stop(row, DraftToken(0, 0.5, h, 0.1)) for h in (0.0, 0.99, 1.0, 1.01, float("nan"))]
    assert stops == [False, False, False, True, True]
    assert engine_step(policy, [None], []) == [Decision("d", 6)]


# ---------------------------------------------------------------------- bad settings
@pytest.mark.parametrize("make, match", [
    (lambda: SglangAdaptive({"1": {"candidate_steps": []}}), "candidate_steps must be a non-empty list"),
    (lambda: SglangAdaptive({"1": {"candidate_steps": [1, -2]}}), "integers >= 0"),
    (lambda: SglangAdaptive({"ema_alpha": 0.2}), "batch-size keys"),
    (lambda: SglangAdaptive({"1": {"candidate_steps": [1, 2]}}), r"initial_steps=3 .* not among .* \[1, 2\]"),
    (lambda: SglangAdaptive({"1": {"candidate_steps": [1], "ema_alpha": 1.5}}), r"ema_alpha must be a number in"),
    (lambda: SglangAdaptive({"1": {"candidate_steps": [1], "update_interval": 0}}), "update_interval must be"),
    (lambda: SglangAdaptive({"1": {"candidate_steps": [1], "warmup": 3}}), r"unknown setting\(s\) \['warmup'\]"),
    (lambda: TrtllmAdaptive(4, acceptance_rate_window_size=8, acceptance_rate_threshold=1.5), r"in \[0, 1\]"),
    (lambda: TrtllmAdaptive(4, acceptance_rate_window_size=0, acceptance_rate_threshold=0.5), "turn the gate off"),
    (lambda: TrtllmAdaptive(4, acceptance_rate_window_size=8), "together"),
    (lambda: TrtllmAdaptive(4, {2: 4}), "must map batch size 1 to max_draft_len=4"),
    (lambda: TrtllmAdaptive(4, {1: 4, 4: -1}), "draft length in"),
    (lambda: TrtllmAdaptive(4, scope="batch"), "scope must be"),
    (lambda: TrtllmAdaptive(0), "max_draft_len must be an integer >= 1"),
    (lambda: VllmBatchSchedule([]), "non-empty list"),
    (lambda: VllmBatchSchedule([[1, 8, 2], [5, 16, 1]]), "overlap"),
    (lambda: VllmBatchSchedule([[2, 8, 2]]), "must start at batch size 1"),
    (lambda: VllmBatchSchedule([[1, 8, -1]]), "k must be >= 0"),
    (lambda: VllmBatchSchedule([[8, 1, 2]]), "1 <= start <= end"),
    (lambda: VllmBatchSchedule([[1, 8]]), "three integers"),
    (lambda: VllmAdaptiveVerification(_flat_cost(), num_speculative_tokens=-1), "num_speculative_tokens must be"),
    (lambda: AcceptanceEstimator(4, refit_interval=0), "refit_interval"),
    (lambda: LlamaCppPMin(p_min=1.2), r"p_min \(--draft-p-min\) must be a number in \[0, 1\]"),
    (lambda: LlamaCppPMin(draft_max=-1), "draft_max"),
    (lambda: LlamaCppPMin(draft_max=4, draft_min=5), r"draft_min \(--draft-min\) must be an integer in \[0, draft_max"),
    (lambda: AdaEDL(threshold=-0.1), r"threshold must be a number in \[0, 1\]"),
    (lambda: AdaEDL(gamma=0.0), "gamma must be"),
    (lambda: AdaEDL(k=0), "k must be an integer >= 1"),
])
def test_bad_settings_are_refused_naming_the_option_and_the_fix(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("make, match", [
    (lambda: SglangAdaptive(), "exceeds the decoder's k_max=4"),  # slot 1's tier 7
    (lambda: TrtllmAdaptive(6), "exceeds the decoder's k_max=4"),
    (lambda: VllmBatchSchedule([[1, 8, 6]]), "exceeds the decoder's k_max=4"),
    (lambda: LlamaCppPMin(), "exceeds the decoder's k_max=4"),  # --draft-max 16
    (lambda: VllmAdaptiveVerification(_flat_cost(), 2, drafter=None), "no draft curve for drafter 'x'"),
    (lambda: AdaEDL(k=2, drafter="y"), "drafter 'y' is not among"),
])
def test_settings_the_decoder_cannot_run_are_refused_before_decoding(make, match):
    with pytest.raises(ValueError, match=match):
        make().validate(("d", "x"), 4)


# ---------------------------------------------------------------------- replayed, live, tuned
@pytest.fixture(scope="module")
def synth():
    grouped = group_traces(synthetic_traces(24, length=32, drafters=("draft", "ngram")))
    return grouped, cost_model(["draft", "ngram"])


@pytest.mark.parametrize("name", sorted(PEERS))
def test_every_peer_replays_on_traces(synth, name):
    grouped, cost = synth
    policy = build_peer(name, peer_grid(name, 8)[0], cost, "draft")
    res = simulate(policy, grouped, cost, vocab_size=V, drafters=["draft"])
    ar = simulate(Autoregressive(), grouped, cost, vocab_size=V)
    assert res.tokens == ar.tokens and res.drafted > 0 and res.target_calls < ar.target_calls
    assert res.tokens_per_s > 0 and all(s.drafted <= 8 for _, r in res.results for s in r.steps)


def test_tuning_picks_the_fastest_setting_on_validation_traces(synth):
    grouped, cost = synth
    val = {p: v for p, v in grouped.items() if assign_split(p) == "val"} or dict(list(grouped.items())[:4])
    for name in ("llamacpp", "vllm_schedule"):
        policy, settings, tps = tune_peer(name, val, cost, vocab_size=V, drafter="draft", k_max=4)
        rates = [simulate(build_peer(name, s, cost, "draft"), val, cost, vocab_size=V, drafters=["draft"]).tokens_per_s
                 for s in peer_grid(name, 4)]
        assert tps == max(rates) == simulate(policy, val, cost, vocab_size=V, drafters=["draft"]).tokens_per_s
        assert settings == peer_grid(name, 4)[rates.index(tps)] and type(policy) is PEERS[name]
    for k_max in (1, 2, 8):  # every setting of every grid runs within the k_max it was made for
        for peer in PEERS:
            for settings in peer_grid(peer, k_max):
                build_peer(peer, settings, cost, "draft").validate(("draft", "ngram"), k_max)
    with pytest.raises(ValueError, match="no validation traces"):
        tune_peer("adaedl", {}, cost, vocab_size=V)
    with pytest.raises(ValueError, match="unknown peer 'vllm'"):
        peer_grid("vllm", 4)


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """Greedy teacher-forced traces of an order-1 Markov target with a Markov draft that half agrees with it (its
    blocks are accepted on some prompts, rejected on others) and the n-gram drafter."""
    v = 16
    P, Q = markov_pair(v, 3)
    target = SimpleNamespace(model=Markov(P.log()), device=torch.device("cpu"), dtype=torch.float32,
                             eos_token_ids=[], spec="markov")
    drafters = [ModelDrafter(Markov((0.5 * P + 0.5 * Q).log()), name="q"), NgramDrafter(name="ngram")]
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_id": f"p{i}", "category": "writing", "input_ids": torch.randint(0, v, (8,), generator=g)
                .tolist()} for i in range(4)]
    out = tmp_path_factory.mktemp("peers-tf")
    collect_teacher_forced(target, drafters, prompts, out, max_new_tokens=N_NEW, k_max=8, meta={"target": "markov"},
                           chunk_size=4, progress=False)
    return target, prompts, drafters, group_traces(load_traces(out, kind="teacher_forced", target="markov")), v


@pytest.mark.parametrize("name", sorted(PEERS))
def test_every_peer_decodes_live_losslessly(tiny_target, tiny_draft, traced, name):
    """Greedy output equals the target's own, one request and two decoded together (batch-size rules in play): on the
    tiny transformers target with a random draft model, and on the Markov target whose draft it often rejects."""
    markov, _, markov_drafters, _, _ = traced
    cases = [(tiny_target.model, [ModelDrafter(tiny_draft.model, name="q")], [None], [[5, 6, 7, 8] * 6, [9, 3, 11, 40]]),
             (markov.model, markov_drafters, [None, "ngram"], [[1, 2, 3, 4, 5, 6, 7, 8], [3, 3, 9, 1]])]
    cost = cost_model(["q", "ngram"])
    rejected = 0
    for model, drafters, names, prompts in cases:
        want = [SpeculativeDecoder(model, [], Autoregressive(), stop_token_ids=[]).generate(p, N_NEW).tokens
                for p in prompts]
        for drafter in names:  # None: the decoder's first drafter, the model draft
            dec = SpeculativeDecoder(model, drafters, build_peer(name, peer_grid(name, 4)[0], cost, drafter),
                                     stop_token_ids=[])
            outs = [dec.generate(p, N_NEW) for p in prompts] + dec.generate_batch(prompts, N_NEW, max_batch=2)
            assert [r.tokens for r in outs] == want + want
            rejected += sum(s.accepted < s.drafted for r in outs for s in r.steps)
    assert rejected > 0  # drafts were rejected too: the output is the target's in spite of them


@pytest.mark.parametrize("make", [
    lambda cost: SglangAdaptive({"warmup_batches": 1, "update_interval": 1, "ema_alpha": 0.5,
                                 "1": {"candidate_steps": [1, 2, 4]}}, initial_steps=2, drafter="q"),
    lambda cost: SglangAdaptive({"warmup_batches": 1, "update_interval": 1, "ema_alpha": 0.5,
                                 "1": {"candidate_steps": [1, 2, 4]}}, initial_steps=1, drafter="ngram"),
    lambda cost: TrtllmAdaptive(3, acceptance_rate_window_size=2, acceptance_rate_threshold=0.6, drafter="q"),
    lambda cost: TrtllmAdaptive(3, acceptance_rate_window_size=2, acceptance_rate_threshold=0.6, scope="request",
                                drafter="q"),
    lambda cost: VllmAdaptiveVerification(cost, 4, refit_interval=2, drafter="q"),
    lambda cost: VllmAdaptiveVerification(cost, 4, refit_interval=2, drafter="ngram"),
], ids=["sglang-q", "sglang-ngram", "trtllm-engine", "trtllm-request", "vllm-adaptive-q", "vllm-adaptive-ngram"])
def test_a_learning_peer_replays_its_live_decisions_step_for_step(tiny_target, traced, make):
    """Greedy: the simulator drives the real decoder, so a peer that learns across steps and requests decides the same
    k, accepts the same tokens and drafts the same tokens on the target's prefix, prompt after prompt, live and
    replayed (the prompts in the simulator's order, one policy for all of them)."""
    target, prompts, drafters, grouped, v = traced
    cost = cost_model([d.name for d in drafters])
    sim = simulate(make(cost), grouped, cost, vocab_size=v)
    live_policy = make(cost)
    by_id = {p["prompt_id"]: p for p in prompts}
    ks = []
    for pid, (_, replayed) in zip(grouped, sim.results):
        live = SpeculativeDecoder(target.model, drafters, live_policy, stop_token_ids=[]).generate(
            by_id[pid]["input_ids"], N_NEW)
        steps = lambda res: [(s.k, s.accepted, min(s.drafted, s.accepted + 1)) for s in res.steps]
        assert steps(replayed) == steps(live), pid
        ks += [s.k for s in live.steps]
    assert len(set(ks)) > 1  # the peer's decisions moved with what it saw


def test_evaluation_tunes_each_peer_on_validation_traces_replays_it_and_decodes_the_best_live(traced, monkeypatch):
    """The evaluation (``evaluation.evaluate``): every peer tuned on the validation traces it is given and nothing else
    (what the tuner received is recorded), replayed on the test traces as peer-<name>, the fastest on val decoded
    live as best-peer (eval.live_policies names it), each tuned setting in the meta for the audit."""
    from sacpolicy.evaluation.evaluate import EvalSettings, evaluate
    from sacpolicy.traces import peer_tuning

    target, prompts, drafters, grouped, _ = traced
    val, test = ({p: grouped[p] for p in ids} for ids in (("p0", "p1"), ("p2", "p3")))
    received, tune = {}, peer_tuning.tune_peer

    def recording(name, grouped_val, *args, **kwargs):
        received[name] = set(grouped_val)
        return tune(name, grouped_val, *args, **kwargs)

    monkeypatch.setattr(peer_tuning, "tune_peer", recording)
    settings = EvalSettings(ks=(2,), k_max=4, live_prompts=2, max_new_tokens=N_NEW, price_per_hour=1.0,
                            confidence_grid=(0.5,), live_policies=("ar", "best-peer"), ceilings=False,
                            speed_probe_every=0, resamples=200)
    held_out = [p for p in prompts if p["prompt_id"] in test]
    rows, meta = evaluate(target=target, drafters=drafters, cost=cost_model([d.name for d in drafters]),
                          val_grouped=val, test_grouped=test, test_prompts=held_out, rules={}, settings=settings,
                          best_static={"drafter": "q", "k": 4}, progress=False)
    assert list(received) == list(PEERS) and all(ids == {"p0", "p1"} for ids in received.values())  # val alone
    by = {(r["name"], r["mode"]): r for r in rows}
    for name, tuned in meta["peers"].items():
        assert tuned["settings"] in peer_grid(name, 4) and ("peer-" + name, "simulated") in by
        assert by["peer-" + name, "simulated"]["per_prompt"]["tokens"] == by["ar", "simulated"]["per_prompt"]["tokens"]
    best = meta["best_peer"]
    assert meta["peers"][best]["val_tokens_per_s"] == max(p["val_tokens_per_s"] for p in meta["peers"].values())
    assert {n for n, m in by if m == "live"} == {"ar", "best-peer"} and by["best-peer", "live"]["speedup_vs_ar_ci"]
    # the best peer live is the peer replayed: the same tokens drafted and accepted (greedy replay is exact)
    assert by["best-peer", "simulated"]["tokens_per_call"] == by["peer-" + best, "simulated"]["tokens_per_call"]
    assert by["best-peer", "live"]["tokens_per_call"] == pytest.approx(by["best-peer", "simulated"]["tokens_per_call"])
    with pytest.raises(ValueError, match=r"eval.peers \['vllm'\] name no peer; peers are \['sglang'"):
        evaluate(target=target, drafters=drafters, cost=cost_model([d.name for d in drafters]), val_grouped=val,
                 test_grouped=test, test_prompts=[], rules={}, best_static={"drafter": "q", "k": 4}, progress=False,
                 settings=EvalSettings(ks=(2,), k_max=4, live_prompts=0, max_new_tokens=N_NEW, price_per_hour=1.0,
                                       confidence_grid=(0.5,), peers=("vllm",)))

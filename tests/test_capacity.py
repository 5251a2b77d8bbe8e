"""Capacity at a latency target (sacpolicy.bench.capacity): the bounded rate search on deterministic latency curves,
no server."""

from __future__ import annotations

import json

import pytest

from sacpolicy.bench.capacity import (
    Capacity,
    MeasureError,
    Search,
    Target,
    cost_per_million,
    find_capacity,
    markdown,
    mean_interval,
)


class Queue:
    """A server of ``mu`` requests/s seen through M/M/1-shaped latencies: TPOT and TTFT grow as 1 / (1 - rate / mu)
    and requests fail past saturation. ``jitter`` adds a repeat-dependent offset to the throughputs (the intervals)."""

    def __init__(self, mu: float, tpot_ms: float = 20.0, ttft_ms: float = 100.0, tokens: float = 100.0,
                 jitter: float = 0.0):
        self.mu, self.tpot, self.ttft, self.tokens, self.jitter = mu, tpot_ms, ttft_ms, tokens, jitter
        self.calls: list[tuple[float, int]] = []

    def __call__(self, rate: float, rep: int) -> dict:
        self.calls.append((rate, rep))
        load = rate / self.mu
        if load >= 1:
            return {"failed": 3, "completed": 5, "p90_tpot_ms": 1e4, "p99_ttft_ms": 1e5,
                    "request_throughput": self.mu, "output_throughput": self.mu * self.tokens}
        served = rate * (1 + self.jitter * (rep - 0.5))
        return {"failed": 0, "completed": 8, "p90_tpot_ms": self.tpot / (1 - load),
                "p99_ttft_ms": self.ttft / (1 - load), "request_throughput": served,
                "output_throughput": served * self.tokens}


def test_the_search_converges_on_the_rate_where_the_target_breaks():
    # P90 TPOT = 20 / (1 - r / 10) <= 25 ms  <=>  r <= 2 requests/s
    q = Queue(mu=10.0)
    got = find_capacity(q, Target(tpot_p90_ms=25.0), Search(start=0.5, repeats=2, max_probes=20, tol=0.02))
    assert got.status == "converged", got.message
    lo, hi = got.bracket
    assert lo <= 2.0 < hi and hi / lo <= 1.02
    assert got.rate == lo and got.at_capacity().passed
    assert all(len(p.runs) == 2 for p in got.probes) and len(q.calls) == 2 * len(got.probes)
    assert [p.rate for p in got.probes[:3]] == [0.5, 1.0, 2.0]  # doubling brackets it first
    # the TTFT bound binds too: 100 / (1 - r / 10) <= 150  <=>  r <= 10 / 3; with both, the tighter one wins
    both = find_capacity(Queue(mu=10.0), Target(tpot_p90_ms=40.0, ttft_p99_ms=150.0),
                         Search(start=1.0, max_probes=20, tol=0.01))
    assert both.status == "converged" and 3.2 <= both.rate <= 10 / 3
    assert any("P99 TTFT" in w for p in both.probes for w in p.why)


def test_a_start_above_capacity_halves_down_to_it():
    got = find_capacity(Queue(mu=10.0), Target(tpot_p90_ms=25.0), Search(start=16.0, max_probes=20, tol=0.05))
    assert got.status == "converged" and 1.9 <= got.rate <= 2.0
    assert [p.rate for p in got.probes[:4]] == [16.0, 8.0, 4.0, 2.0]
    assert "failed requests" in " ".join(got.probes[0].why)  # past saturation a request failure misses the target


def test_a_target_no_rate_meets_is_refused_with_what_was_measured():
    # unloaded TPOT is 20 ms: a 15 ms target is unmeetable at any rate
    q = Queue(mu=10.0)
    got = find_capacity(q, Target(tpot_p90_ms=15.0), Search(start=1.0, max_probes=50, min_rate=0.125))
    assert got.status == "unmeetable" and got.rate is None
    assert [p.rate for p in got.probes] == [1.0, 0.5, 0.25, 0.125]  # down to the floor, no further
    assert "P90 TPOT" in got.message and "0.125" in got.message
    assert got.figures(2.0) == {}
    assert "unmeetable" in markdown({"none": got.to_dict(2.0)}, got.target, 2.0)


def test_the_search_stops_at_its_bound_and_says_how_far_it_got():
    q = Queue(mu=10.0)
    got = find_capacity(q, Target(tpot_p90_ms=25.0), Search(start=0.5, max_probes=4, tol=0.001))
    assert got.status == "bound" and len(got.probes) == 4 == len(q.calls)
    lo, hi = got.bracket
    assert lo <= 2.0 < hi and got.rate == lo and "at least" in got.message
    # every rate met within the bound: a lower bound, no upper one
    up = find_capacity(Queue(mu=1000.0), Target(tpot_p90_ms=25.0), Search(start=1.0, max_probes=3))
    assert up.status == "bound" and up.bracket == [4.0, None] and "lower bound" in up.message
    # every rate missed within the bound, above the floor
    down = find_capacity(Queue(mu=10.0), Target(tpot_p90_ms=15.0), Search(start=8.0, max_probes=2))
    assert down.status == "bound" and down.rate is None and down.bracket == [None, 4.0]


def test_a_dead_server_stops_the_search_and_keeps_every_measurement(tmp_path):
    q = Queue(mu=10.0)
    written = []

    def measure(rate, rep):
        if len(q.calls) == 5:
            raise MeasureError("the server at http://127.0.0.1:1 does not answer")
        return q(rate, rep)

    def keep(state: Capacity):  # what the script does: the JSON rewritten after every repeat
        written.append(json.loads(json.dumps(state.to_dict())))

    got = find_capacity(measure, Target(tpot_p90_ms=25.0), Search(start=0.5, repeats=2, max_probes=20), on_probe=keep)
    assert got.status == "error" and "does not answer" in got.message
    assert [len(p.runs) for p in got.probes] == [2, 2, 1]  # the unfinished probe's completed repeat is kept
    assert got.probes[-1].passed is None and got.rate == 1.0
    assert len(written) == 5 and written[-1]["status"] == "running"
    assert sum(len(p["runs"]) for p in written[-1]["probes"]) == 5


def test_figures_at_capacity_carry_intervals_over_repeats_and_a_price():
    got = find_capacity(Queue(mu=10.0, jitter=0.1), Target(tpot_p90_ms=25.0),
                        Search(start=0.5, repeats=3, max_probes=20, tol=0.05))
    f = got.figures(price_per_hour=3.6)
    lo, hi = f["output_throughput_ci"]
    assert lo < f["output_throughput"] < hi and f["repeats"] == 3
    assert f["usd_per_1m_output_tokens"] == pytest.approx(1e6 / 1000 / f["output_throughput"])
    assert cost_per_million(3.6, 1000.0) == pytest.approx(1.0)
    assert mean_interval([5.0]) == (5.0, None) and mean_interval([None]) == (None, None)
    # a configuration with twice the capacity reads 2x none's and half its cost per token
    fast = find_capacity(Queue(mu=20.0, jitter=0.1), Target(tpot_p90_ms=25.0),
                         Search(start=0.5, repeats=3, max_probes=20, tol=0.05))
    md = markdown({"none": got.to_dict(3.6), "fast": fast.to_dict(3.6)}, got.target, 3.6)
    assert "| fast | converged |" in md and "| 2.00 |" in md.split("| fast |")[1]


def test_bad_targets_and_searches_are_refused():
    with pytest.raises(ValueError, match="needs a P90 TPOT bound"):
        Target()
    with pytest.raises(ValueError, match="positive"):
        Target(tpot_p90_ms=-1.0)
    with pytest.raises(ValueError, match="positive finite"):
        Search(start=float("inf"))
    with pytest.raises(ValueError, match="min_rate"):
        Search(start=1.0, min_rate=2.0)


# ---------------------------------------------------------------------- the script's mode, servers faked
class FakeServers:
    """Stand-ins for bench_serve's ``VllmServer``, ``completions`` and ``bench_serve``: each configuration a queue
    (``Queue``'s curves: capacity ``mu`` requests/s, unloaded TPOT ``tpot`` ms); ``dies_after``: {config: runs}
    after which its server stops answering; ``no_start``: configurations whose server never comes up."""

    def __init__(self, queues: dict[str, tuple[float, float]], dies_after: dict[str, int] | None = None,
                 no_start: tuple[str, ...] = ()):
        self.queues, self.dies_after, self.runs, self.no_start = queues, dies_after or {}, {}, no_start
        world = self

        class Server:
            def __init__(self, model, config, **kw):
                self.name, self.url = config.name, f"fake://{config.name}"

            def __enter__(self):
                if self.name in world.no_start:
                    from sacpolicy.export.vllm_serve import ServeError

                    raise ServeError(f"the vLLM server ({self.name}) exited with code 1 before it was healthy")
                return self

            def __exit__(self, *exc):
                return None

            def alive(self):
                return world.runs.get(self.name, 0) < world.dies_after.get(self.name, 10**9)

            healthy = alive

            def log_tail(self, lines=25):
                return "engine core died"

        self.Server = Server

    def bench_serve(self, url, dataset, out, *, num_prompts, rate, max_tokens, model, log=None, max_concurrency=None):
        name = url.removeprefix("fake://")
        self.runs[name] = self.runs.get(name, 0) + 1
        mu, tpot = self.queues[name]
        if max_concurrency == 1:  # one request at a time: unloaded
            load = mu * 0.01
        else:  # all at once (rate inf): the queue at saturation, served at its capacity
            load = min(rate, mu * 0.999)
        row = Queue(mu=mu, tpot_ms=tpot)(load, 0)
        return {**row, "median_tpot_ms": row["p90_tpot_ms"], "errors": [""] * num_prompts,
                "generated_texts": [f"text {i}" for i in range(num_prompts)], "request_throughput": min(rate, mu)}


def _run_capacity(tmp_path, monkeypatch, world: FakeServers, *extra: str) -> tuple[int, dict]:
    from sacpolicy import bench
    from tests.toys import load_script

    cli = load_script("bench_serve")

    class Tok:
        def decode(self, ids):
            return " ".join(map(str, ids))

    monkeypatch.setattr(cli, "vllm_status", lambda: (True, "fake vLLM"))
    monkeypatch.setattr(cli, "served_model", lambda: tmp_path / "model")
    monkeypatch.setattr(cli, "load_tokenizer", lambda spec: Tok())
    monkeypatch.setattr(bench, "held_out_prompts", lambda *a, n=None, **k: [{"input_ids": [i, 1]} for i in range(n)])
    monkeypatch.setattr(cli, "VllmServer", world.Server)
    monkeypatch.setattr(cli, "completions", lambda *a, **k: [])
    monkeypatch.setattr(cli, "bench_serve", world.bench_serve)
    out = tmp_path / "cap.json"
    rc = cli.main(["--find-capacity", "--prompts", "4", "--out", str(out), "--workdir", str(tmp_path / "w"),
                   "--max-probes", "12", *extra])
    return rc, json.loads(out.read_text())


def test_bench_serve_finds_each_configurations_capacity_and_keeps_a_dead_servers_probes(tmp_path, monkeypatch):
    # none: 20 / (1 - r / 4) <= 1.5 x 20 ms <=> r <= 4/3; vllm-ngram: 15 / (1 - r / 6) <= 30 <=> r <= 3
    world = FakeServers({"none": (4.0, 20.0), "vllm-ngram": (6.0, 15.0), "none-sync": (4.0, 20.0)},
                        dies_after={"none-sync": 3})
    rc, got = _run_capacity(tmp_path, monkeypatch, world, "--configs", "vllm-ngram,none,none-sync",
                            "--tpot-target-x", "1.5", "--price-per-hour", "2", "--repeats", "2")
    assert rc == 0
    res = got["results"]
    assert list(res) == ["none", "vllm-ngram", "none-sync"]  # none first: the reference
    assert got["target"]["tpot_p90_ms"] == pytest.approx(30.0, rel=0.02)
    assert res["none"]["status"] == "converged" and 1.2 <= res["none"]["rate"] <= 4 / 3
    assert res["vllm-ngram"]["status"] == "converged" and 2.7 <= res["vllm-ngram"]["rate"] <= 3.0
    assert res["vllm-ngram"]["at_capacity"]["usd_per_1m_output_tokens"] < res["none"]["at_capacity"][
        "usd_per_1m_output_tokens"]
    assert res["none-sync"]["status"] == "error" and "does not answer" in res["none-sync"]["message"]
    # its server died in its third run (the second rate's second repeat): the three runs before are kept
    assert [len(p["runs"]) for p in res["none-sync"]["probes"]] == [2, 1]
    assert "| vllm-ngram | converged |" in got["markdown"]


def test_bench_serve_says_when_no_configuration_meets_the_target(tmp_path, monkeypatch, capsys):
    world = FakeServers({"none": (4.0, 20.0), "vllm-ngram": (6.0, 15.0)})
    rc, got = _run_capacity(tmp_path, monkeypatch, world, "--configs", "none,vllm-ngram", "--tpot-target-ms", "5")
    assert rc == 2 and "no configuration met the target" in capsys.readouterr().err
    assert {r["status"] for r in got["results"].values()} == {"unmeetable"}
    assert all(len(r["probes"]) >= 2 for r in got["results"].values())  # every probe kept


def test_bench_serve_refuses_a_search_without_a_target_and_keeps_what_a_dead_reference_left(tmp_path, monkeypatch,
                                                                                           capsys):
    with pytest.raises(SystemExit):
        _run_capacity(tmp_path, monkeypatch, FakeServers({"none": (4.0, 20.0)}), "--configs", "none")
    assert "needs a latency target" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _run_capacity(tmp_path, monkeypatch, FakeServers({"none": (4.0, 20.0)}), "--tpot-target-x", "0")
    # the no-speculation server answers nothing: the run ends naming it, its JSON written
    world = FakeServers({"none": (4.0, 20.0), "vllm-ngram": (6.0, 15.0)}, dies_after={"none": 0})
    with pytest.raises(SystemExit, match="reference run failed: the server at fake://none does not answer"):
        _run_capacity(tmp_path, monkeypatch, world, "--configs", "none,vllm-ngram", "--tpot-target-x", "1.5")
    assert json.loads((tmp_path / "cap.json").read_text())["results"] == {}
    # its server never comes up: no reference, so no other configuration is measured against it
    world = FakeServers({"none": (4.0, 20.0), "vllm-ngram": (6.0, 15.0)}, no_start=("none",))
    with pytest.raises(SystemExit, match=r"reference run failed: the vLLM server \(none\) exited"):
        _run_capacity(tmp_path, monkeypatch, world, "--configs", "none,vllm-ngram", "--tpot-target-x", "1.5")
    assert world.runs == {}
    # another configuration's server never comes up: its row says why, the others are measured
    world = FakeServers({"none": (4.0, 20.0), "vllm-ngram": (6.0, 15.0)}, no_start=("vllm-ngram",))
    rc, got = _run_capacity(tmp_path, monkeypatch, world, "--configs", "none,vllm-ngram", "--tpot-target-x", "1.5")
    assert rc == 0 and got["results"]["none"]["status"] == "converged"
    assert got["results"]["vllm-ngram"]["status"] == "error" and "exited" in got["results"]["vllm-ngram"]["message"]

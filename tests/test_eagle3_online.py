"""EAGLE-3 features online and cached: the target in the training step trains the head exactly as a cache of the
same tokens does and writes nothing; a cache is read the same through DataLoader workers (fork or spawn) as in the
training process."""

import lightning as L
import pytest
import torch
from safetensors.torch import load_file
from test_eagle3 import AUX, Recorder, sequences, tiny_target, trainer  # noqa: F401
from torch.utils.data import DataLoader

from sacpolicy.training.eagle3 import Eagle3Settings, train_eagle3
from sacpolicy.training.eagle3_data import FeatureCaches, build_feature_cache


class FrozenTarget(L.Callback):
    """What the online module's target looks like at every training step: mode, gradients, optimizer share."""

    def __init__(self):
        self.seen = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        optimized = {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]}
        target = list(module.target.parameters())
        self.seen.append((module.target.training, any(p.requires_grad for p in target),
                          any(id(p) in optimized for p in target), "ids" in batch))


def test_online_features_train_as_a_cache_of_the_same_tokens_and_write_nothing(tiny_target, sequences,  # noqa: F811
                                                                               tmp_path):
    s = Eagle3Settings(draft_vocab_size=256, steps=3, lr=1e-3, max_steps=8, budget_minutes=None, patience=1000,
                       warmup_steps=2, batch_size=8, aux_layer_ids=AUX, val_check_interval=4)
    train, val = sequences[:32], sequences[48:]
    # the cache in the target's dtype (float32 here), read by two DataLoader workers
    caches = {split: FeatureCaches([build_feature_cache(tiny_target, rows, tmp_path / "cache" / split, AUX,
                                                        dtype=torch.float32, progress=False)])
              for split, rows in (("train", train), ("val", val))}
    cached, online, frozen = Recorder(), Recorder(), FrozenTarget()
    m_cached = train_eagle3(tiny_target, [], [], Eagle3Settings(**{**s.__dict__, "num_workers": 2}),
                            trainer(tmp_path), tmp_path / "cached", callbacks=[cached], progress=False, caches=caches)
    m_online = train_eagle3(tiny_target, train, val, Eagle3Settings(**{**s.__dict__, "features": "online"}),
                            trainer(tmp_path), tmp_path / "online", callbacks=[online, frozen], progress=False)
    assert len(online.loss) == len(cached.loss) == 8 and m_online["global_step"] == m_cached["global_step"] == 8
    torch.testing.assert_close(torch.tensor(online.loss), torch.tensor(cached.loss), atol=1e-5, rtol=0)
    assert online.accept == pytest.approx(cached.accept, abs=1e-6) and len(online.accept) == 3  # sanity + 2 checks
    # the target ran in eval mode, frozen, outside the optimizer, on batches of token ids
    assert frozen.seen == [(False, False, False, True)] * 8
    # nothing cached on disk; the checkpoint and the export hold the head alone, trained as the cached run's
    run = tmp_path / "online"
    assert not (run / "features").exists()
    assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*.safetensors")) == ["head/model.safetensors"]
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    assert ckpt and all(k.startswith("head.") for k in ckpt), sorted(ckpt)[:5]
    a, b = (load_file(str(r / "head" / "model.safetensors")) for r in (run, tmp_path / "cached"))
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    # resuming the online run loads its head-only checkpoint (the target's weights are not expected back)
    s2 = Eagle3Settings(**{**s.__dict__, "features": "online", "max_steps": 9})
    assert train_eagle3(tiny_target, train, val, s2, trainer(tmp_path), run, progress=False)["global_step"] == 9


def test_online_features_refuse_caches_and_unknown_modes(tiny_target, sequences, tmp_path):  # noqa: F811
    with pytest.raises(ValueError, match="head.features='disk'.*use 'cached'"):
        Eagle3Settings(max_steps=1, features="disk")
    cache = build_feature_cache(tiny_target, sequences[:2], tmp_path, AUX, progress=False)
    s = Eagle3Settings(max_steps=1, budget_minutes=None, features="online", aux_layer_ids=AUX, draft_vocab_size=64)
    with pytest.raises(ValueError, match="pass the sequences instead, or use head.features=cached"):
        train_eagle3(tiny_target, [], [], s, trainer(tmp_path), tmp_path / "run", progress=False,
                     caches={"train": cache, "val": cache})


def _items(dataset, **loader) -> list[dict]:
    return list(DataLoader(dataset, batch_size=None, **loader))


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_cache_reads_the_same_through_workers(tiny_target, sequences, tmp_path, context):  # noqa: F811
    caches = FeatureCaches([build_feature_cache(tiny_target, sequences[:5], tmp_path / "a", AUX, shard_size=2,
                                                progress=False),
                            build_feature_cache(tiny_target, sequences[5:8], tmp_path / "b", AUX, shard_size=2,
                                                progress=False)])
    alone = _items(caches)
    assert len(alone) == 8 and [it["input_ids"].tolist() for it in alone] == [r["input_ids"] for r in sequences[:8]]
    workers = _items(caches, num_workers=2, multiprocessing_context=context)
    assert [sorted(it) for it in workers] == [sorted(it) for it in alone]
    for x, y in zip(workers, alone):
        assert x["prompt_len"] == y["prompt_len"]
        assert all(torch.equal(x[k], y[k]) for k in ("input_ids", "aux", "final", "top"))


def test_the_online_modules_target_is_frozen_unsaved_and_outside_ddp(tiny_target, tmp_path):  # noqa: F811
    """The module holding the target: its optimizer and its state dict hold the head alone, a head-only state dict
    loads back strictly, and DDP (a 1-rank gloo group) neither broadcasts nor reduces the target's weights."""
    import torch.distributed as dist
    from test_eagle3 import random_head

    from sacpolicy.training.eagle3 import Eagle3Module

    head = random_head(tiny_target).train()
    rows = tiny_target.model.get_output_embeddings().weight[head.draft_ids]
    module = Eagle3Module(head, rows, Eagle3Settings(max_steps=1), target=tiny_target.model)
    head_params = {id(p) for p in head.parameters()}
    optimized = {id(p) for p in module.configure_optimizers()["optimizer"].param_groups[0]["params"]}
    assert optimized == head_params
    state = module.state_dict()
    assert state.keys() == {f"head.{k}" for k in head.state_dict()}
    module.load_state_dict(state)  # strict: the target's weights are not expected back
    module.train()
    assert module.head.training and not module.target.training
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(module)
        assert {id(p) for p in ddp._module_parameters} == head_params
    finally:
        dist.destroy_process_group()

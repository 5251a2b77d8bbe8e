"""Train an EAGLE-3 head on a frozen target with the training-time test (TTT), as a LightningModule.

    from sacpolicy.training.eagle3 import Eagle3Settings, train_eagle3
    metrics = train_eagle3(target, train_seqs, val_seqs, Eagle3Settings(steps=3), trainer_factory, "runs/eagle3")
    drafter = load_feature_drafter(target, "runs/eagle3/head")        # sacpolicy.decoding.eagle3

Loss (SpecForge's): at every continuation row and chain step j, the forward KL(p || q) (SpecForge's soft
cross-entropy minus p's entropy: the same gradient, 0 at a perfect draft) of the draft distribution q to p, the
target's distribution restricted to the draft vocabulary and renormalised; rows whose target argmax lies outside the
draft vocabulary are masked; step weights 0.8^j.
Validation: per step j, the greedy agreement with the target's argmax conditional on steps < j agreeing
(``val/acc_step{j}``), and ``val/accept_len`` = sum_k prod_{i <= k} acc_i, the expected accepted tokens per block of
``steps`` greedy drafts.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import lightning as L
import torch
from safetensors.torch import save_file

from sacpolicy.decoding.eagle3 import (
    CONFIG_FILE,
    PROVENANCE_FILE,
    WEIGHTS_FILE,
    Eagle3Config,
    Eagle3Head,
    load_head,
    vocab_hash,
)
from sacpolicy.io import write_dir, write_json
from sacpolicy.training.common import MinuteLog, StepAcceptance, WarmupAdamW, config_hash

logger = logging.getLogger(__name__)

__all__ = ["Eagle3Module", "Eagle3Settings", "FeatureLoaders", "draft_vocabulary", "head_layers", "init_head",
           "load_head", "save_head", "train_eagle3"]


DEFAULT_DRAFT_VOCAB = 8192
CACHE_DTYPES = ("float16", "bfloat16", "float32")


@dataclass
class Eagle3Settings:
    """Everything an EAGLE-3 training run depends on."""

    draft_vocab_size: int | None = None  # None: 8192 from scratch, the warm-start head's with init_from
    aux_layer_ids: list | None = None  # None: [2, L // 2, L - 3]
    steps: int = 3  # TTT steps (SpecForge trains 7)
    step_decay: float = 0.8
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    decay_steps: int | None = None  # cosine decay of lr to 0 over this many steps after warm-up; None: constant lr
    batch_size: int = 8
    budget_minutes: float | None = 20.0
    max_steps: int | None = None
    patience: int = 4
    val_check_interval: float = 1.0
    seed: int = 0
    # warm start: None (from scratch: fc random, the layer from the target's last), "shipped" (the head that ships
    # for this target, sacpolicy.heads) or a head directory; its vocabulary and aux layers are kept
    init_from: str | None = None
    # "cached": the target's features computed once into a cache on disk, then read (small targets, several epochs);
    # "online": the frozen target runs in every training step, nothing on disk (large targets, large data)
    features: str = "cached"
    num_workers: int = 0  # DataLoader workers per loader (persistent); 0 reads in the training process
    # the feature cache's storage dtype: float16 (half the disk of float32), or bfloat16 for a target whose hidden
    # states overflow float16's range (Gemma's reach beyond 65504)
    cache_dtype: str = "float16"

    def __post_init__(self) -> None:
        if self.steps < 1 or not 0 < self.step_decay <= 1 or self.lr <= 0:
            raise ValueError("eagle3 needs steps >= 1, 0 < step_decay <= 1 and lr > 0")
        if self.features not in ("cached", "online"):
            raise ValueError(f"head.features={self.features!r}; use 'cached' (a feature cache on disk) or 'online' "
                             "(the target in the training step)")
        if self.cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"head.cache_dtype={self.cache_dtype!r}; use one of {list(CACHE_DTYPES)} (bfloat16 for "
                             "a target whose hidden states overflow float16)")
        if self.num_workers < 0:
            raise ValueError(f"head.num_workers={self.num_workers}; use 0 (read in the training process) or more")
        if not (self.budget_minutes or self.max_steps or self.init_from):
            raise ValueError("give budget_minutes or max_steps: training from scratch needs a budget (a budget of 0 "
                             "is allowed with init_from: the warm-start head is then used as it is)")

    @property
    def trains(self) -> bool:
        return bool(self.budget_minutes or self.max_steps)

    def identity(self) -> dict:
        """What a checkpoint must agree on to be resumed (the budget and how features are read may change between
        runs; the warm-start head enters by its checksum, not its path)."""
        skip = ("budget_minutes", "max_steps", "patience", "init_from", "features", "num_workers", "cache_dtype")
        return {k: v for k, v in asdict(self).items() if k not in skip}


def warm_start_dir(init_from: str | None, target) -> Path | None:
    """The head directory ``init_from`` names for ``target``: None, "shipped" (verified by its checksum) or a path."""
    if init_from is None:
        return None
    if init_from == "shipped":
        from sacpolicy.heads import shipped_head

        return shipped_head(target.spec)
    path = Path(init_from)
    if not (path / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"head.init_from={init_from!r} is not an EAGLE-3 head directory (no {CONFIG_FILE}); "
                                "give a head directory, 'shipped' or null")
    return path


def head_layers(settings: Eagle3Settings, target) -> list[int]:
    """The target layers whose inputs the head of ``settings`` reads: the warm-start head's, else the settings' or
    the default for the target."""
    init_dir = warm_start_dir(settings.init_from, target)
    if init_dir is not None:
        return list(json.loads((init_dir / CONFIG_FILE).read_text())["aux_layer_ids"])
    return list(Eagle3Config.from_target(target.model.config, 1, settings.aux_layer_ids).aux_layer_ids)


def draft_vocabulary(sequences, target, size: int) -> torch.Tensor:
    """The ``size`` most frequent target ids in the sequences' continuations (the target's stop tokens always in),
    sorted: the draft vocabulary's target ids."""
    from sacpolicy.training.distill_data import token_counts
    from sacpolicy.training.drafts import select_vocab

    vocab = int(target.model.config.vocab_size)
    if not 0 < size <= vocab:
        raise ValueError(f"draft_vocab_size must be in [1, {vocab}] (the target's vocabulary), got {size}")
    return select_vocab(token_counts(list(sequences), vocab), size, always=target.eos_token_ids)


@torch.no_grad()
def init_head(target, config: Eagle3Config, draft_ids: torch.Tensor, seed: int = 0) -> Eagle3Head:
    """A head for ``target`` (a ``LoadedModel``): fc random; the layer from the target's last decoder layer where the
    shapes allow (q/k/v: the target's weights on the hidden half, small random on the embedding half; both input
    norms from its input norm); final norm and LM-head rows (of the draft vocabulary) from the target's."""
    model = target.model
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = Eagle3Head(config, model.get_input_embeddings()).float()
        last, layer, H = model.model.layers[-1], head.layers[0], config.hidden_size
        for name in ("q_proj", "k_proj", "v_proj"):
            w = getattr(last.self_attn, name).weight.float()
            mine = getattr(layer.self_attn, name).weight
            mine[:, H:] = w
            mine[:, :H] = torch.randn_like(w) * 0.1 * w.std()
        layer.self_attn.o_proj.weight.copy_(last.self_attn.o_proj.weight)
        layer.mlp.load_state_dict(last.mlp.state_dict())
        for norm in (layer.input_layernorm, layer.hidden_norm):
            norm.weight.copy_(norm_scale(last.input_layernorm, H))
        # the norm before the MLP: Gemma's layers name it pre_feedforward_layernorm (their post_attention_layernorm
        # scales the attention output), Llama's post_attention_layernorm
        pre_mlp = getattr(last, "pre_feedforward_layernorm", None) or last.post_attention_layernorm
        layer.post_attention_layernorm.weight.copy_(norm_scale(pre_mlp, H))
        head.norm.weight.copy_(norm_scale(model.model.norm, H))
        ids = torch.as_tensor(draft_ids, dtype=torch.long)
        head.lm_head.weight.copy_(model.get_output_embeddings().weight[ids.to(model.device)])
        head.set_vocab(ids)
    return head.to(target.device)


@torch.no_grad()
def norm_scale(norm: torch.nn.Module, hidden_size: int) -> torch.Tensor:
    """The per-channel scale an RMSNorm of the target applies, as the head's Llama RMSNorm holds it (``x * w``): its
    output on a vector of ones (RMS 1). Read from the output, not the weight, since families store it differently:
    Gemma's norms keep ``w`` and scale by ``1 + w``."""
    weight = next(norm.parameters())
    return norm(torch.ones(1, hidden_size, device=weight.device, dtype=weight.dtype))[0].float()


class Eagle3Module(WarmupAdamW, StepAcceptance, L.LightningModule):
    """The head under training. With ``target`` (online features) the frozen target model is a submodule, so it moves
    to the module's device, but its parameters do not train (``requires_grad`` off: not in the optimizer), DDP
    neither broadcasts nor reduces them (every rank loaded the same target), it stays in eval mode, and its weights
    are left out of the state dict (checkpoints hold the head alone) and not expected back when one is loaded. Batches of token ids (``collate_sequences``) then become
    feature batches in the step itself (``online_features``); feature batches from a cache pass through."""

    checkpoint_key, run_kind = "sacpolicy_eagle3_config", "EAGLE-3"

    def __init__(self, head: Eagle3Head, target_lm_rows: torch.Tensor, settings: Eagle3Settings,
                 config_id: dict | None = None, target: torch.nn.Module | None = None):
        super().__init__()
        self.head = head
        # [Vd, H]: the target's LM-head rows of the draft vocabulary (target logits on the fly); not saved
        self.register_buffer("target_rows", target_lm_rows.detach().float(), persistent=False)
        self.target = target
        if target is not None:
            target.requires_grad_(False).eval()
            frozen = [f"target.{n}" for n, _ in (*target.named_parameters(), *target.named_buffers())]
            torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(self, frozen)
            self.register_state_dict_post_hook(_drop_target_weights)
            self.register_load_state_dict_post_hook(_target_weights_not_expected)
        s = settings
        self.steps, self.step_decay, self.lr = s.steps, s.step_decay, s.lr
        self.acceptance_steps = s.steps
        self.weight_decay, self.warmup_steps, self.decay_steps = s.weight_decay, s.warmup_steps, s.decay_steps
        self.config_hash = config_hash(config_id)

    def train(self, mode: bool = True):
        super().train(mode)
        if self.target is not None:  # frozen: eval mode even while the head trains
            self.target.eval()
        return self

    def _features(self, batch: dict) -> dict:
        if "aux" in batch:
            return batch
        from sacpolicy.training.eagle3_data import online_features

        return online_features(self.target, batch, self.head.config.aux_layer_ids)

    def _ttt(self, batch):
        """-> (loss, per-step draft argmax [B, T] in target ids, per-step target top [B, T], per-step rows [B, T])."""
        steps = self.head.ttt_forward(batch["input_ids"], batch["aux"], self.steps, batch["valid"])
        with torch.no_grad():  # [B, T, Vd]: row u = the target at position u + 1, over the draft vocabulary
            log_p = torch.log_softmax(batch["final"].float() @ self.target_rows.T, dim=-1)
        T = batch["input_ids"].shape[1]
        u = torch.arange(T, device=self.device)
        loss, preds, tops, rows = 0.0, [], [], []
        for j, logits in enumerate(steps):
            shift = torch.clamp(u + j, max=T - 1)  # step j at row t reads the target at row t + j
            row = ((u + j)[None] < batch["length"][:, None]) & ((u + j)[None] >= batch["first"][:, None])
            top = batch["top"][:, shift]
            mask = row & self.head.t2d[top]
            logp = torch.log_softmax(logits.float(), dim=-1)
            kl = (log_p[:, shift].exp() * (log_p[:, shift] - logp)).sum(-1)  # [B, T]: soft CE minus p's entropy
            loss = loss + self.step_decay ** j * (kl * mask).sum() / mask.sum().clamp_min(1)
            preds.append(self.head.draft_ids[logits.argmax(-1)])
            tops.append(top)
            rows.append(row)
        return loss, preds, tops, rows

    def training_step(self, batch, batch_idx):
        batch = self._features(batch)
        loss, *_ = self._ttt(batch)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"EAGLE-3 loss is {loss.item()} at step {self.global_step} (batch {batch_idx}); "
                                     "lower the learning rate or rebuild the feature cache, then resume")
        self.log("train/loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return loss

    def validation_step(self, batch, batch_idx):
        batch = self._features(batch)
        loss, preds, tops, rows = self._ttt(batch)
        # chains that start where inference drafts (row t >= prompt_len - 1, i.e. first + 1) and stay in the sequence
        start = torch.arange(batch["input_ids"].shape[1], device=self.device)[None] > batch["first"][:, None]
        self.count_chains(start, rows, [p == t for p, t in zip(preds, tops)])
        self.log("val/loss", loss, batch_size=batch["input_ids"].shape[0], sync_dist=True)


    def on_fit_start(self):
        """The target's embedding the head reads is shared, not a submodule: when the module trains on another
        device than the target sits on (a rank's GPU), the head reads a frozen copy on its own device."""
        embed = self.head._embed[0]
        if embed.weight.device != self.device:
            logger.info("the target's embedding is on %s, the head trains on %s: using a frozen copy there",
                        embed.weight.device, self.device)
            self.head._embed[0] = torch.nn.Embedding.from_pretrained(embed.weight.detach().to(self.device),
                                                                      freeze=True)


def _drop_target_weights(module, state_dict, prefix, local_metadata) -> None:
    for key in [k for k in state_dict if k.startswith(prefix + "target.")]:
        del state_dict[key]


def _target_weights_not_expected(module, incompatible_keys) -> None:
    keys = incompatible_keys.missing_keys
    keys[:] = [k for k in keys if not (k.startswith("target.") or ".target." in k)]


class FeatureLoaders(L.LightningDataModule):
    """The head's loaders, made once Lightning knows this rank: training batches from ``LengthBuckets`` (this rank's
    share of the length buckets), validation sequences strided over the ranks. ``data``: {"train", "val"} feature
    caches with ``collate_features`` (the default) or ``Sequences`` with ``collate_sequences`` (token ids, for online
    features); ``num_workers`` persistent workers per loader."""

    def __init__(self, data: dict, batch_size: int, seed: int = 0, num_workers: int = 0, collate=None):
        super().__init__()
        self.data, self.batch_size, self.seed, self.num_workers = data, batch_size, seed, num_workers
        self.collate = collate

    def _ranks(self) -> dict:
        t = self.trainer
        return {"num_replicas": t.world_size, "rank": t.global_rank} if t is not None else {}

    def _loader(self, split: str, **kw):
        from torch.utils.data import DataLoader

        from sacpolicy.training.eagle3_data import collate_features

        return DataLoader(self.data[split], collate_fn=self.collate or collate_features, num_workers=self.num_workers,
                          persistent_workers=self.num_workers > 0, **kw)

    def train_dataloader(self):
        from sacpolicy.training.eagle3_data import LengthBuckets

        lengths = self.data["train"].lengths
        return self._loader("train", batch_sampler=LengthBuckets(lengths, self.batch_size, seed=self.seed,
                                                                  **self._ranks()))

    def val_dataloader(self):
        from sacpolicy.training.eagle3_data import Strided

        return self._loader("val", batch_size=self.batch_size, sampler=Strided(len(self.data["val"]), **self._ranks()))


# ---------------------------------------------------------------------- checkpoint files
def save_head(head: Eagle3Head, out_dir, provenance: dict) -> Path:
    """Write our checkpoint: ``model.safetensors`` (speculators names, no embedding), ``config.json``,
    ``provenance.json``. JSON and safetensors only; written to a temporary sibling, then renamed."""
    def fill(tmp: Path) -> None:
        save_file({k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}, str(tmp / WEIGHTS_FILE))
        write_json(tmp / CONFIG_FILE, head.config.to_dict())
        write_json(tmp / PROVENANCE_FILE, provenance)

    return write_dir(out_dir, fill)


# ---------------------------------------------------------------------- the whole stage
def train_eagle3(target, train_seqs, val_seqs, settings: Eagle3Settings, trainer_factory, out_dir, logger=None,
                 callbacks=(), progress: bool = True, caches: dict | None = None, data: dict | None = None) -> dict:
    """Train a head for ``target`` on sequences (rows with ``input_ids``, ``prompt_len``), resuming from
    ``out_dir/checkpoints/last.ckpt``; features cached under ``out_dir/features`` (``features="cached"``) or computed
    by the target in each step (``"online"``: nothing written); the best head (by ``val/accept_len``) saved to
    ``out_dir/head``. ``trainer_factory(**kwargs)`` builds a ``lightning.Trainer``. ``caches``: {"train", "val"}
    feature caches built elsewhere (``sacpolicy.training.head_data``) instead of sequences; ``data``: their recipe,
    recorded in the head's provenance as this leg's data."""
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    from sacpolicy import ranks
    from sacpolicy.training.eagle3_data import Sequences, build_feature_cache, collate_sequences

    s, out_dir = settings, Path(out_dir)
    online = s.features == "online"
    if online and caches is not None:
        raise ValueError("head.features=online computes the features in the training step, yet feature caches were "
                         "given; pass the sequences instead, or use head.features=cached")
    init_dir = warm_start_dir(s.init_from, target)
    if init_dir is None:
        size = s.draft_vocab_size or DEFAULT_DRAFT_VOCAB
        config = Eagle3Config.from_target(target.model.config, size, s.aux_layer_ids, verifier=target.spec,
                                          vocab_hash=vocab_hash(target.tokenizer))
        seqs = caches["train"].sequences() if caches is not None else train_seqs
        draft_ids = draft_vocabulary(seqs, target, size)
        head = init_head(target, config, draft_ids, seed=s.seed)
        origin = {}
    else:
        head, origin = _warm_head(init_dir, target, s)
        config, draft_ids = head.config, head.draft_ids.cpu()
    if not s.trains:  # budget 0: the warm-start head as it is
        metrics = {"val/accept_len": None, "global_step": 0}
        if ranks.current().zero:
            save_head(head, out_dir / "head", {**_provenance_of(init_dir), "settings": asdict(s), "metrics": metrics,
                                               "target": target.spec, "trained_here": False})
        ranks.barrier()
        return metrics
    if online:
        caches = {"train": Sequences(train_seqs), "val": Sequences(val_seqs)}
    elif caches is None:  # built by rank 0, read by the others
        caches = ranks.rank_zero_first(lambda: {
            split: build_feature_cache(target, seqs, out_dir / "features" / split, config.aux_layer_ids,
                                       dtype=getattr(torch, s.cache_dtype), progress=progress)
            for split, seqs in (("train", train_seqs), ("val", val_seqs))}, "the head's feature caches")
    for split, cache in ({} if online else caches).items():
        if cache.aux_layer_ids != list(config.aux_layer_ids):
            raise ValueError(f"the {split} feature cache {cache.dir} holds aux layers {cache.aux_layer_ids}, the head "
                             f"reads {list(config.aux_layer_ids)}; build the cache for the head's layers")
    rows = target.model.get_output_embeddings().weight[draft_ids.to(target.device)]
    module = Eagle3Module(head, rows, s, config_id={"target": target.spec, "draft_ids": draft_ids.tolist(),
                                                 **origin, **s.identity()}, target=target.model if online else None)
    ckpt_dir = out_dir / "checkpoints"
    best = ModelCheckpoint(dirpath=ckpt_dir, filename="best", monitor="val/accept_len", mode="max", save_last=True)
    kwargs = {"callbacks": [best, EarlyStopping(monitor="val/accept_len", mode="max", patience=s.patience,
                                                check_on_train_epoch_end=False), MinuteLog("EAGLE-3 head"),
                            *callbacks],
              "logger": logger if logger is not None else False, "val_check_interval": s.val_check_interval,
              "use_distributed_sampler": False}  # FeatureLoaders shares the data out over the ranks itself
    if s.budget_minutes:
        kwargs["max_time"] = {"minutes": s.budget_minutes}
    if s.max_steps:
        kwargs["max_steps"] = s.max_steps
    trainer = trainer_factory(**kwargs)
    last = ckpt_dir / "last.ckpt"
    loaders = FeatureLoaders(caches, s.batch_size, s.seed, s.num_workers, collate_sequences if online else None)
    trainer.fit(module, datamodule=loaders,
                ckpt_path=str(last) if last.is_file() else None)
    if best.best_model_path:
        module.load_state_dict(torch.load(best.best_model_path, map_location="cpu", weights_only=True)["state_dict"])
    score = best.best_model_score
    metrics = {"val/accept_len": None if score is None else float(score), "global_step": trainer.global_step,
               "world_size": trainer.world_size, "train_batches_per_rank": int(trainer.num_training_batches)}
    if trainer.is_global_zero:
        leg = {"command": " ".join(sys.argv), "settings": asdict(s), "metrics": metrics,
               "train_sequences": len(caches["train"]), "train_tokens": sum(caches["train"].lengths),
               "val_sequences": len(caches["val"]),
               "data": data or {"source": "the target's continuations of the training prompts (distill data)"}}
        save_head(head, out_dir / "head", {**leg, "target": target.spec, **_legs_of(init_dir, leg), **origin})
    trainer.strategy.barrier("head saved")  # the other ranks' next stages load it
    return metrics


def _warm_head(init_dir: Path, target, s: Eagle3Settings):
    """(head loaded from ``init_dir`` in float32 for training, {"init_sha256": ...}) after checking it fits."""
    from sacpolicy.decoding.eagle3 import check_target
    from sacpolicy.runtime.artifact import file_sha256

    config = Eagle3Config.from_dict(json.loads((init_dir / CONFIG_FILE).read_text()))
    check_target(config, target, where=f"the warm-start head {init_dir}")
    clash = [f"{name}: settings {mine}, head {theirs}" for name, mine, theirs in (
        ("draft_vocab_size", s.draft_vocab_size, config.draft_vocab_size),
        ("aux_layer_ids", s.aux_layer_ids, config.aux_layer_ids)) if mine is not None and mine != theirs]
    if clash:
        raise ValueError(f"the warm-start head {init_dir} was built with other shapes ({'; '.join(clash)}); set "
                         "those settings to the head's, or head.init_from=null to train from scratch")
    head = load_head(init_dir, target.model.get_input_embeddings(), device=target.device, dtype=torch.float32)
    head.train()
    return head, {"init_sha256": file_sha256(init_dir / WEIGHTS_FILE)}


def _legs_of(init_dir: Path | None, leg: dict) -> dict:
    """The training legs behind a head: its warm-start head's (a shipped head's provenance lists them) and this one."""
    prov = init_dir / PROVENANCE_FILE if init_dir else None
    before = json.loads(prov.read_text()) if prov is not None and prov.is_file() else {}
    return {"init_from": str(init_dir) if init_dir else None, "legs": [*before.get("legs", []), leg]}


def _provenance_of(init_dir: Path) -> dict:
    prov = init_dir / PROVENANCE_FILE
    return {"init_from": str(init_dir), "init_provenance": json.loads(prov.read_text()) if prov.is_file() else None}

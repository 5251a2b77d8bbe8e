"""``FeatureDrafter``: the drafter protocol over an EAGLE-3 head (``sacpolicy.decoding.eagle3``), fed the target's
hidden states by the decoder after every target pass."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from sacpolicy.decoding.eagle3 import CONFIG_FILE, Eagle3Config, Eagle3Head, KVCache, check_target, load_head
from sacpolicy.decoding.sampling import SamplingConfig, draft_stats, select_token
from sacpolicy.decoding.types import DraftBlock, Drafter, TeacherForced


class FeatureDrafter(Drafter):
    """Drafts a chain with an ``Eagle3Head`` from the target's hidden states.

    State: the feature rows of committed positions (``extend_features``; row t pairs with token t + 1) and the head's
    KV cache. Invariant between steps: the cache holds the true entries of the rows fed so far; a proposal feeds the
    pending (row, token) pairs, then one chain entry per drafted token but the last. Chain entries were computed from
    the head's own hidden states, so ``accept`` crops all of them; the accepted tokens return as true pairs with the
    next rows."""

    def __init__(self, head: Eagle3Head, name: str = "feature"):
        self.head, self.name = head, name
        self.vocab_size = head.config.target_vocab_size
        self.aux_layers = tuple(head.config.aux_layer_ids)
        self.reset()

    def reset(self) -> None:
        self._pending: list[torch.Tensor] = []  # [m, A] rows not fed yet
        self._rows = 0  # rows received this request
        self._cache = KVCache()
        self._true = 0  # true entries in the cache
        self._tail = None  # (pre-norm output [1, 1, H], draft logits [Vd]) of the last true entry

    def extend_features(self, aux: torch.Tensor) -> None:
        width = len(self.aux_layers) * self.head.config.hidden_size
        if aux.dim() != 2 or aux.shape[-1] != width:
            raise ValueError(f"feature rows must be [m, {width}] (aux layers {list(self.aux_layers)}), got "
                             f"{tuple(aux.shape)}")
        self._pending.append(aux)
        self._rows += aux.shape[0]

    def _take_pending(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pending (row, token) pairs, now counted as fed: feature rows [m, A] and their tokens [m]. The caller runs
        them through the head (``propose_batch``: every row's at once), which caches them as true entries."""
        rows = torch.cat(self._pending)
        m, start = rows.shape[0], self._true
        self._pending, self._true = [], start + m
        return rows, context[start + 1 : start + 1 + m]

    def propose(self, context, k, sampling: SamplingConfig, generator=None, stop=None) -> DraftBlock:
        return self.propose_batch([self], [context], [k], [sampling], [generator], [stop])[0]

    def _start(self, context, k: int, label: str) -> bool:
        """Settle the last proposal and say whether to propose (the rows handed over since still to feed)."""
        n = context.shape[0]
        if self._rows != n - 1:
            raise ValueError(f"{label} holds hidden states of {self._rows} positions but the context has {n} tokens "
                             f"(it needs {n - 1}: every committed position but the last); the decoder must call "
                             "extend_features after every target pass")
        self.accept(0)  # drop the chain of an unsettled proposal
        return k > 0 and n >= 2

    @torch.inference_mode()
    def propose_batch(self, rows, contexts, ks, samplings, generators, stops) -> list[DraftBlock]:
        """Every row's block (``rows``: this drafter's forks; ``propose`` is one row), each drafted token's draft logits
        from ONE output projection over the rows still drafting: the projection to the vocabulary is most of a head
        step, and one matrix product over b rows reads its weights once instead of b times. The layer runs once over
        every row's entries too (``Eagle3Head.layer_step_rows``: its projections and MLP over all of them, the
        attention per row on the row's own cache, since rows hold caches of different lengths), for each drafted token
        and for the target features handed over since each row's last proposal, whose last outputs share one
        projection."""
        out: list[DraftBlock | None] = [None] * len(rows)
        tails, fed = {}, {}
        for i, (d, c, k) in enumerate(zip(rows, contexts, ks)):
            if not d._start(c, k, "the feature drafter" if len(rows) == 1 else f"the feature drafter of row {i}"):
                out[i] = DraftBlock.empty(c.device)
            elif d._pending:  # target features handed over since the row's last proposal: fed below
                fed[i] = d._take_pending(c)
            else:
                tails[i] = d._tail
        if fed:  # every fed row's entries through the layer at once; their last outputs through one projection
            feats, ids = (torch.cat(parts) for parts in zip(*fed.values()))
            counts = [f.shape[0] for f, _ in fed.values()]
            hidden = self.head.fc(feats.to(self.head.fc.weight.dtype)).unsqueeze(0)  # [1, M, H]
            h = self.head.layer_step_rows(hidden, ids.view(1, -1), [rows[i]._cache for i in fed], counts)
            last = h[0, torch.tensor(counts, device=h.device).cumsum(0) - 1].unsqueeze(1)  # [b, 1, H]
            logits = self.head.logits(last)  # [b, 1, Vd]
            for r, i in enumerate(fed):
                rows[i]._tail = tails[i] = (last[r : r + 1], logits[r, -1])
        tails = dict(sorted(tails.items()))
        live = list(tails)
        tokens: dict[int, list] = {i: [] for i in live}
        block_logits: dict[int, list] = {i: [] for i in live}
        while live:
            # the live rows' draft logits at once, over the draft vocabulary: its argmax is the full vocabulary's (ties
            # included: ``set_vocab``) and q = 0 outside it, so the confidence is the same, 6x fewer logits to read
            # than per row over the target's vocabulary (``scripts/bench_head.py --stop`` times it)
            trimmed = torch.stack([tails[i][1] for i in live])  # [b, Vd]
            greedy = self.head.draft_ids[trimmed.argmax(-1)]
            stats = draft_stats(trimmed) if any(stops[i] is not None for i in live) else None
            going = []
            for r, i in enumerate(live):
                tok = greedy[r] if samplings[i].greedy else select_token(
                    self.head.full_logits(trimmed[r]), samplings[i], generators[i])
                tokens[i].append(tok)
                block_logits[i].append(trimmed[r])
                n = len(tokens[i])
                if not (n == ks[i] or (stops[i] is not None and stops[i](n - 1, stats[r]))):
                    going.append(i)
            if going:
                h = self.head.layer_step_rows(torch.cat([tails[i][0] for i in going], dim=1),
                                              torch.cat([tokens[i][-1].view(1) for i in going]).view(1, -1),
                                              [rows[i]._cache for i in going], [1] * len(going))  # [1, b, H]
                logits = self.head.logits(h)  # [1, b, Vd]
                for r, i in enumerate(going):
                    tails[i] = (h[:, r : r + 1], logits[0, r])
            live = going
        for i, drafted in tokens.items():
            out[i] = DraftBlock(torch.stack(drafted), self.head.full_logits(torch.stack(block_logits[i])))
        return out

    def accept(self, n_accepted: int) -> None:
        self._cache.crop(self._true)

    @torch.inference_mode()
    def teacher_force(self, ids, start, k_max, aux=None) -> TeacherForced:
        """Row g: the greedy chain proposed after ``ids[:start + g]``, all rows from ONE ``ttt_forward`` of k_max
        greedy steps (row g's chain starts at feature row start + g - 2)."""
        N = ids.shape[0]
        if aux is None or aux.shape[0] < N - 2:
            raise ValueError(f"a feature drafter's teacher_force needs aux: the target's hidden states at aux layers "
                             f"{list(self.aux_layers)} for the first {N - 2} positions at least")
        if start < 2:
            raise ValueError(f"a feature drafter proposes after two committed tokens at least; start={start}")
        if start >= N or k_max <= 0:
            return TeacherForced(ids.new_zeros(0, max(k_max, 0)), chained=True,
                                 logits=self.head.lm_head.weight.new_zeros(0, self.vocab_size))
        steps = self.head.ttt_forward(ids[1 : N - 1].view(1, -1), aux[: N - 2].unsqueeze(0), k_max, greedy=True)
        rows = slice(start - 2, N - 2)
        tokens = torch.stack([self.head.draft_ids[s[0, rows].argmax(-1)] for s in steps], dim=-1)  # [G, k_max]
        return TeacherForced(tokens, chained=True, logits=self.head.full_logits(steps[0][0, rows]))


def load_feature_drafter(target, path, name: str = "feature") -> FeatureDrafter:
    """The head at ``path`` (our checkpoint directory) as a drafter for ``target`` (a ``LoadedModel``), on the target's
    device and dtype, after checking that the head was trained for this target."""
    if not (Path(path) / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{path} is not an EAGLE-3 head directory (no {CONFIG_FILE}); point draft.feature.path "
                                "at the head directory written by EAGLE-3 training")
    config = Eagle3Config.from_dict(json.loads((Path(path) / CONFIG_FILE).read_text()))
    check_target(config, target, where=f"the EAGLE-3 head at {path}")
    head = load_head(path, target.model.get_input_embeddings(), device=target.device, dtype=target.dtype)
    return FeatureDrafter(head, name=name)

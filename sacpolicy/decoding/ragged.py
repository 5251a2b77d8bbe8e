"""The target's KV cache for a batch of rows of different lengths (``RaggedCache``), over transformers'
``DynamicCache``.

Rows join with their prompts' cache (prefilled together) and leave when they finish; every step feeds T tokens per row
(the last committed token, the row's draft block, then padding up to the longest block) and keeps the first
``kept[i]`` of them (the committed ones). Rejected and padded columns are not copied out: a [B, width] ``valid`` map
masks them from every later query, and each row's positions count only its own valid columns. The garbage all rows
share at the end is cropped at once (with one row, that is all of it: B = 1 never builds a mask, exactly the
single-sequence path). When the garbage inside the cache grows past ``slack`` of its width, ``compact`` gathers each
row's valid columns to the right (one copy of the cache).

A row may feed a token tree instead of a chain (``inputs(trees=...)``: its nodes attend their ancestors, at positions
by depth); ``commit(columns=...)`` then moves the accepted path's columns to the front before keeping them, so every
row's cache stays what its committed sequence alone would give.

Masks are additive floats (0 or the dtype's minimum), passed as transformers' custom 4D mask: a query with nothing to
attend (a padded slot) stays finite, and masked columns get exactly zero weight. A target with sliding-window layers
(``layout.AttentionLayout``) keeps every token's keys and values in those layers too, so rollback and tree moves are
the same crops and gathers; its window is in the mask, counted in each row's own positions.

``new_cache``: the decoder's caches append in place once they hold several rows (``GrowingLayer``) where transformers'
``DynamicLayer`` copies the whole cache into a new tensor on every forward, a copy that grows with rows x context
(measured: docs/benchmarks.md, "CPU kernels").
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from sacpolicy.decoding.layout import FULL, SLIDING, AttentionLayout, attention_layout, layer_types

_HEADROOM = 0.25  # a growing layer reallocates with this share of its length (at least _MIN_HEADROOM tokens) to spare
_MIN_HEADROOM = 64


class GrowingLayer(DynamicLayer):
    """transformers' ``DynamicLayer`` whose keys and values are views of a buffer with room to spare: ``update`` writes
    the new tokens in place instead of concatenating (a copy of the whole layer per forward). The views behave as
    ``DynamicLayer``'s tensors: ``crop`` narrows them (the next update overwrites the cropped columns), and whoever
    assigns ``keys``/``values`` other tensors (``RaggedCache`` joining, compacting or selecting rows) makes the next
    update copy them into a new buffer. Tensors returned by an earlier update must not be read after a crop and a later
    update (the decoder never does). One row and autograd concatenate, as ``DynamicLayer`` does: at one row the copy
    is small and attention reads a contiguous cache faster than the buffer's view, so the in-place append pays only
    from several rows on (docs/benchmarks.md, "CPU kernels")."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._kv_buffers = None  # (keys, values) buffers [B, H, capacity, D]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] == 1 or key_states.requires_grad or value_states.requires_grad:
            self._kv_buffers = None  # one row (or autograd): concatenation, as transformers does
            return super().update(key_states, value_states, *args, **kwargs)
        n = self.get_seq_length()
        m = n + key_states.shape[-2]
        if not self._holds(key_states, value_states, m):
            self._reallocate(key_states, value_states, n, m)
        kb, vb = self._kv_buffers
        kb[:, :, n:m].copy_(key_states)
        vb[:, :, n:m].copy_(value_states)
        self.keys, self.values = kb[:, :, :m], vb[:, :, :m]
        return self.keys, self.values

    def _holds(self, key_states, value_states, m: int) -> bool:
        """The current keys/values are prefixes of this layer's buffers, which have room for m tokens of this kind."""
        if not self._in_buffer():
            return False
        for buf, new in zip(self._kv_buffers, (key_states, value_states)):
            if (buf.shape[-2] < m or new.shape[:2] != buf.shape[:2] or new.dtype != buf.dtype
                    or new.device != buf.device):
                return False
        return True

    def _in_buffer(self) -> bool:
        """The current keys/values are prefixes of this layer's buffers (same rows), which may be written here."""
        buffers = getattr(self, "_kv_buffers", None)
        if buffers is None:
            return False
        for cur, buf in zip((self.keys, self.values), buffers):
            if (cur.data_ptr() != buf.data_ptr() or cur.stride() != buf.stride() or cur.shape[:2] != buf.shape[:2]
                    or (buf.is_inference() and not torch.is_inference_mode_enabled())):
                return False
        return True

    def keep_rows(self, rows: list[int]) -> None:
        """Keep these rows (increasing indices), in order. Inside the layer's buffer this moves only the kept rows
        after the first one left out, each up into the slot before it (the buffer keeps its spare rows and columns,
        so the next ``update`` appends in place); otherwise transformers' index select (a copy of every kept row,
        and a new buffer at the next update)."""
        if not self._in_buffer() or any(b <= a for a, b in zip(rows, rows[1:])):
            self.batch_select_indices(torch.tensor(rows, dtype=torch.long, device=self.keys.device))
            return
        n = self.keys.shape[-2]
        kept = []
        for buf in self._kv_buffers:
            for slot, row in enumerate(rows):
                if row != slot:  # row > slot: its source is never a slot written before it
                    buf[slot, :, :n].copy_(buf[row, :, :n])
            kept.append(buf[: len(rows)])
        self._kv_buffers = tuple(kept)
        self.keys, self.values = kept[0][:, :, :n], kept[1][:, :, :n]

    def adopt(self, keys: list[torch.Tensor], values: list[torch.Tensor], width: int) -> None:
        """Hold these blocks of rows, stacked in order and each left-padded with zeros to ``width`` columns, in a new
        buffer with room to grow: one copy of each block, where a concatenation and the next update's reallocation
        would copy them twice."""
        capacity = width + max(_MIN_HEADROOM, int(_HEADROOM * width))
        self._kv_buffers = tuple(_left_padded_stack(parts, width, capacity) for parts in (keys, values))
        self.keys, self.values = (buf[:, :, :width] for buf in self._kv_buffers)
        self.is_initialized = True

    def _reallocate(self, key_states, value_states, n: int, m: int) -> None:
        capacity = m + max(_MIN_HEADROOM, int(_HEADROOM * m))
        bufs = []
        for cur, new in zip((self.keys, self.values), (key_states, value_states)):
            buf = new.new_empty((*new.shape[:2], capacity, new.shape[-1]))
            if n:
                buf[:, :, :n].copy_(cur)
            bufs.append(buf)
        self._kv_buffers = tuple(bufs)


def new_cache(config) -> DynamicCache:
    """An empty KV cache for a model of this config: transformers' ``DynamicCache`` whose full-attention and
    sliding-window layers keep every token and append in place (``GrowingLayer``: a sliding layer's window is the
    mask's, ``layout``); other kinds of layers (chunked, linear attention, ...) stay as transformers builds them."""
    cache = DynamicCache(config=config)
    layers = getattr(cache, "layers", None) or []
    kinds = layer_types(config)
    for i, layer in enumerate(layers):
        kind = kinds[i] if i < len(kinds) else FULL
        if type(layer) is DynamicLayer or (type(layer) is DynamicSlidingWindowLayer and kind == SLIDING):
            layers[i] = GrowingLayer()
    return cache


def _layers(cache: DynamicCache) -> list:
    layers = getattr(cache, "layers", None)
    if layers is None or any(type(layer) not in (DynamicLayer, GrowingLayer) for layer in layers):
        kinds = sorted({type(layer).__name__ for layer in (layers or [])})
        raise ValueError(f"a ragged batch needs KV caches that keep every token of every layer (DynamicLayer); this "
                         f"one has {kinds or 'no cache layers'}. Fix: build it with sacpolicy.decoding.ragged."
                         "new_cache(config), which keeps a sliding-window layer's every token (the decoder's "
                         "caches do); chunked or linear-attention layers cannot be batched")
    return layers


class RaggedCache:
    def __init__(self, cache: DynamicCache, length: int, device: torch.device, slack: float = 0.25,
                 layout: AttentionLayout = AttentionLayout()):
        self.cache, self.device, self.slack = cache, device, slack
        self.layout = layout  # the model's attention: the window a sliding layer's mask adds
        self.counts = [int(length)]  # valid columns per row (host side: no sync to know whether a mask is needed)
        self.width = int(length)
        self.valid = torch.ones(1, self.width, dtype=torch.bool, device=device)
        self.compactions = 0

    @property
    def rows(self) -> int:
        return len(self.counts)

    @property
    def ragged(self) -> bool:
        return any(c != self.width for c in self.counts)

    # ------------------------------------------------------------------ a step
    def inputs(self, T: int, dtype: torch.dtype, trees: list | None = None) -> dict:
        """Keyword arguments of a forward feeding T tokens per row: nothing when every row's cache is full and every
        row feeds a chain (the default causal mask and positions are right), else per-row positions and the 4D mask.
        ``trees``: per row None (a chain: causal) or (mask [T, T] bool, offsets [T] long) from ``TokenTree.attention``:
        among the fed columns the row attends as the mask says, at positions count + offset."""
        if trees is not None and all(t is None for t in trees):
            trees = None
        if not self.ragged and trees is None:
            return {}
        B, P = self.rows, self.width
        steps = torch.arange(T, device=self.device)
        causal = torch.ones(T, T, dtype=torch.bool, device=self.device).tril_()
        if trees is None:
            offsets, own = steps.expand(B, T), causal.expand(B, T, T)
        else:
            offsets = torch.stack([steps if t is None else t[1] for t in trees])
            own = torch.stack([causal if t is None else t[0] for t in trees])
        pos = torch.tensor(self.counts, device=self.device)[:, None] + offsets
        keys = torch.cat([self.valid[:, None, :].expand(B, T, P), own], dim=-1)
        # a cached column's position is the count of its row's valid columns before it (sliding windows only)
        k_pos = None if self.layout.window is None else torch.cat([self.valid.cumsum(1) - 1, pos], dim=1)
        return {"position_ids": pos, "attention_mask": self.layout.mask(keys, pos, k_pos, dtype)}

    def commit(self, kept: list[int], T: int, columns: list | None = None) -> None:
        """After a forward of T tokens per row: row i keeps its first kept[i] (0 <= kept[i] <= T), or with
        ``columns[i]`` (a list of kept[i] increasing column indices, a token tree's accepted path) those columns,
        moved to the front first so the row's cache stays contiguous (``_gather``)."""
        if len(kept) != self.rows or not all(0 <= k <= T for k in kept):
            raise ValueError(f"commit needs one count in [0, {T}] per row ({self.rows}), got {kept}")
        if columns is not None:
            self._gather(kept, T, columns)
        tail = T - max(kept)  # garbage every row has at the end
        if tail:
            self.cache.crop(-tail)
        keep = T - tail
        if self.rows == 1 and not self.ragged:  # the single-sequence path: nothing to mask
            self.valid = self.valid.new_ones(1, self.width + keep)
        else:
            new = torch.arange(keep, device=self.device)[None] < torch.tensor(kept, device=self.device)[:, None]
            self.valid = torch.cat([self.valid, new], dim=1)
        self.counts = [c + k for c, k in zip(self.counts, kept)]
        self.width += keep
        self._compact_if_sparse()

    def _gather(self, kept: list[int], T: int, columns: list) -> None:
        """Move each row's kept columns among the last T (``columns[i]``, None: its first kept[i]) to the front of
        them, in order, on every layer: one gather over the T fed columns, only when some row keeps others."""
        order = []
        for k, cols in zip(kept, columns):
            cols = list(range(k)) if cols is None else [int(c) for c in cols]
            if len(cols) != k or sorted(set(cols)) != cols or (cols and not 0 <= cols[0] <= cols[-1] < T):
                raise ValueError(f"kept columns must be {k} increasing indices in [0, {T}), got {cols}")
            order.append(cols + [c for c in range(T) if c not in set(cols)])
        if all(o == list(range(T)) for o in order):
            return
        index = torch.tensor(order, device=self.device)
        for layer in _layers(self.cache):
            for t in (layer.keys, layer.values):
                tail = t[:, :, -T:]
                tail.copy_(tail.gather(2, index[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[-1])))

    # ------------------------------------------------------------------ rows join and leave
    @classmethod
    def stack(cls, caches: list, lengths: list[int], device: torch.device, config) -> RaggedCache:
        """A new batch of the given one-row caches (left-padded to the longest; the inputs are left as they were)."""
        if not caches or min(lengths) < 1:
            raise ValueError("stack needs one-row caches holding at least one token each")
        per_row = [_layers(c) for c in caches]
        W = max(lengths)
        out = new_cache(config)
        for i in range(len(per_row[0])):
            out.update(torch.cat([_left_pad(rows[i].keys, W) for rows in per_row]),
                       torch.cat([_left_pad(rows[i].values, W) for rows in per_row]), i)
        batch = cls(out, W, device, layout=attention_layout(config))
        batch.counts = list(lengths)
        batch.valid = torch.cat([_left_pad(torch.ones(1, n, dtype=torch.bool, device=device), W, dim=1)
                                 for n in lengths])
        return batch

    @classmethod
    def prefilled(cls, cache: DynamicCache, lengths: list[int], device: torch.device, slack: float = 0.25,
                  layout: AttentionLayout = AttentionLayout()) -> RaggedCache:
        """The batch of a cache just filled by one pass over prompts of these lengths left-padded to the longest (the
        pass ``prefill_inputs`` describes): row i's valid columns are its last lengths[i]. Several rows need caches
        that keep every token (``new_cache``), as every batch does (one row is the single-sequence cache, of any
        kind)."""
        if len(lengths) > 1:
            _layers(cache)
        W = max(lengths)
        batch = cls(cache, W, device, slack, layout)
        batch.counts = [int(n) for n in lengths]
        batch.valid = _left_padded(lengths, device)
        return batch

    def row_cache(self, i: int, config) -> DynamicCache:
        """Row i alone, its valid columns in order: a one-row cache as a single-sequence decode would hold."""
        cols = self.valid[i].nonzero().squeeze(-1)
        out = new_cache(config)
        for j, layer in enumerate(_layers(self.cache)):
            out.update(layer.keys[i : i + 1, :, cols], layer.values[i : i + 1, :, cols], j)
        return out

    def join(self, *others: RaggedCache) -> None:
        """Append the rows of ``others`` in order (each the cache of requests prefilled together), left-padding every
        block to the widest: one copy of each layer however many join (into a buffer with room to grow where the
        layer appends in place)."""
        if not others:
            return
        mine = _layers(self.cache)
        theirs = [_layers(o.cache) for o in others]
        if any(len(t) != len(mine) for t in theirs):
            raise ValueError(f"caches of {len(mine)} and {[len(t) for t in theirs]} layers cannot be batched")
        W = max(self.width, *(o.width for o in others))
        for i, layer in enumerate(mine):
            keys = [layer.keys] + [t[i].keys for t in theirs]
            values = [layer.values] + [t[i].values for t in theirs]
            if isinstance(layer, GrowingLayer):
                layer.adopt(keys, values, W)
            else:
                layer.keys, layer.values = _left_padded_stack(keys, W, W), _left_padded_stack(values, W, W)
        self.valid = torch.cat([_left_pad(v, W, dim=1) for v in [self.valid, *(o.valid for o in others)]])
        for o in others:
            self.counts += o.counts
        self.width = W

    def select(self, rows: list[int]) -> None:
        """Keep only these rows (finished ones leave and stop costing compute)."""
        if rows == list(range(self.rows)):
            return
        for layer in _layers(self.cache):
            if isinstance(layer, GrowingLayer):
                layer.keep_rows(rows)
            else:
                layer.batch_select_indices(torch.tensor(rows, dtype=torch.long, device=self.device))
        self.valid = self.valid[torch.tensor(rows, dtype=torch.long, device=self.device)]
        self.counts = [self.counts[i] for i in rows]
        self._compact_if_sparse()

    def _compact_if_sparse(self) -> None:
        """Compact once the columns no row needs (beyond the longest row) pass ``slack`` of the width."""
        if self.width - max(self.counts) > max(16, self.slack * self.width):
            self.compact()

    def compact(self) -> None:
        """Gather each row's valid columns to the right end of a cache as wide as the longest row (one copy)."""
        P, W = self.width, max(self.counts)
        order = torch.argsort(self.valid.to(torch.int8), dim=1, stable=True)  # invalid columns first, order kept
        index = order[:, P - W :]  # [B, W]: the row's valid columns, after (W - count) invalid ones
        for layer in _layers(self.cache):
            idx = index[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
            layer.keys, layer.values = layer.keys.gather(2, idx), layer.values.gather(2, idx)
        self.valid = self.valid.gather(1, index)
        self.width = W
        self.compactions += 1


def prefill_inputs(lengths: list[int], device: torch.device, dtype: torch.dtype,
                   layout: AttentionLayout = AttentionLayout()) -> dict:
    """Keyword arguments of one forward over prompts of these lengths, each left-padded to the longest (pads first, so
    every row's last position is its prompt's last token): nothing when all have one length (the default causal mask
    and positions are right), else per-row positions (0 at each prompt's first token, as the prompt alone has them)
    and the additive 4D mask [B, 1, W, W] of ``RaggedCache.inputs``: a token attends to its own prompt up to itself.
    A pad attends to itself only, so no query has every key masked (a case attention kernels may turn into NaN, e.g.
    boolean masks, or minimum values summed in half precision), and no real token ever reads it (nor, after the pass,
    any later query: ``RaggedCache.prefilled`` marks it invalid). ``layout``: the model's attention (a sliding
    window narrows its layers' masks)."""
    W = max(lengths)
    if all(n == W for n in lengths):
        return {}
    real = _left_padded(lengths, device)  # [B, W]
    pos = (torch.arange(W, device=device) - (W - torch.tensor(lengths, device=device))[:, None]).clamp_(min=0)
    causal = torch.ones(W, W, dtype=torch.bool, device=device).tril_()
    keys = (causal & real[:, None, :]) | torch.eye(W, dtype=torch.bool, device=device)  # [B, W queries, W keys]
    return {"position_ids": pos, "attention_mask": layout.mask(keys, pos, pos, dtype)}


def _left_padded(lengths: list[int], device: torch.device) -> torch.Tensor:
    """[B, max(lengths)] bool: True on row i's last lengths[i] columns."""
    W = max(lengths)
    return torch.arange(W, device=device)[None] >= (W - torch.tensor(lengths, device=device))[:, None]


def _left_padded_stack(blocks: list[torch.Tensor], width: int, capacity: int) -> torch.Tensor:
    """[sum of rows, H, capacity, D]: the blocks [b, H, w, D] stacked in order, block columns ending at ``width``
    (zeros before them, so a masked pad column is finite; nothing written after ``width``)."""
    first = blocks[0]
    out = first.new_empty((sum(b.shape[0] for b in blocks), first.shape[1], capacity, first.shape[-1]))
    row = 0
    for b in blocks:
        w = b.shape[-2]
        out[row : row + b.shape[0], :, : width - w].zero_()
        out[row : row + b.shape[0], :, width - w : width].copy_(b)
        row += b.shape[0]
    return out


def _left_pad(x: torch.Tensor, width: int, dim: int = 2) -> torch.Tensor:
    """Pad ``x`` with zeros (False) on the left of ``dim`` up to ``width``."""
    missing = width - x.shape[dim]
    if missing <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)

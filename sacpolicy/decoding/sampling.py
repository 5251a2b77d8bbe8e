"""Sampling and verification math: the one place where probabilities are made and drafts are judged.

Symbols follow the speculative-sampling papers (Leviathan et al. 2023, Chen et al. 2023):
``p`` target probabilities, ``q`` draft probabilities, ``k`` drafted tokens, "bonus token" the extra token the target
samples when every drafted token is accepted. Everything here is pure tensor code: no models, no caches, and no host
syncs but the token-tree walks (``verify_tree``, ``verify_tree_greedy``: sequential over a small tree).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are chosen. ``temperature == 0`` is greedy decoding.

    ``top_k`` (0 = off) and ``top_p`` (1.0 = off) are applied identically to the target and the draft distribution, so
    speculative sampling reproduces sampling from the *processed* target distribution exactly.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = 0

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(
                f"temperature must be >= 0 (0 means greedy), got {self.temperature}; "
                "set sampling.temperature=0 for greedy or a positive value such as 0.7 to sample"
            )
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}; use e.g. sampling.top_p=0.9")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probs_from_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """logits [..., V] -> processed probabilities [..., V] in float32.

    Greedy gives the one-hot of the argmax, which makes the generic verification below reduce to "accept iff the
    drafted token is the target's argmax".
    """
    logits = logits.float()
    if cfg.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / cfg.temperature
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if cfg.top_p < 1.0:
        probs = top_p_filter(probs, cfg.top_p)
    return probs


TOP_P_HEAD = 512  # tokens ranked by a partial sort before top-p falls back to sorting the whole vocabulary


def top_p_filter(probs: torch.Tensor, top_p: float, head: int = TOP_P_HEAD) -> torch.Tensor:
    """Nucleus filtering: drop a token when the mass strictly before it, in descending order, already reaches
    ``top_p`` (the top-1 token always stays); renormalize.

    Only the ``head`` most likely tokens are ranked (``topk``, a partial sort: a full sort of a 49k vocabulary
    costs milliseconds a position on a CPU) when they hold at least ``top_p`` of the mass in every row: every token
    outside them then has at least that mass before it and is dropped, so the result is the full sort's. Flatter rows
    fall back to sorting everything (``head=0``: always). On a CPU only: choosing the path reads a value back to the
    host, which an accelerator pays for and whose sort is fast anyway."""
    if 0 < head < probs.shape[-1] and probs.device.type == "cpu":
        top, order = torch.topk(probs, head, dim=-1)
        if bool((top.sum(-1) >= top_p).all()):
            keep = (torch.cumsum(top, dim=-1) - top) < top_p
            out = torch.zeros_like(probs).scatter(-1, order, top * keep)
            return out / out.sum(-1, keepdim=True)
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)
    drop_sorted = (torch.cumsum(sorted_p, dim=-1) - sorted_p) >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    probs = probs.masked_fill(drop, 0.0)
    return probs / probs.sum(-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None, u: torch.Tensor | None = None) -> torch.Tensor:
    """probs [..., V] (non-negative, not necessarily normalized) -> one token id per row ([...], long), without
    leaving the device.

    Inverse CDF: one uniform u per row, scaled to the row's total mass, and the first token whose cumulative mass
    (float64) exceeds it. A token of zero probability adds nothing to the cumulative mass, so it is never drawn.
    ``torch.multinomial`` draws the same distribution but makes a random number per vocabulary entry on a CPU
    (0.85 ms for 49k tokens against 0.03 ms here; a sampled speculative step draws 2-4 tokens). ``u`` [..., 1]
    float64: uniforms drawn already (``draw_uniforms``), in place of drawing them from ``generator``."""
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)
    total = cdf[..., -1:].contiguous()
    if u is None:
        u = torch.rand(total.shape, generator=generator, device=probs.device, dtype=torch.float64)
    index = torch.searchsorted(cdf, u * total, right=True)
    # u * total can round up to the total itself (u just below 1): the last token with mass, never one beyond it
    return torch.minimum(index, torch.searchsorted(cdf, total)).squeeze(-1)


def select_token(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [V] -> the next token under ``cfg``: argmax when greedy, else a draw from the processed distribution."""
    if cfg.greedy:
        return logits.argmax(-1)
    return sample(probs_from_logits(logits, cfg), generator)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, p - q)): the distribution to sample from after a rejection.

    When p == q a rejection has probability 0; the result is then defined as p so it stays a distribution. The same
    holds when the residual mass (= the rejection probability) is denormal: dividing by it would not normalize.
    """
    r = torch.clamp(p - q, min=0.0)
    total = r.sum(-1, keepdim=True)
    tiny = torch.finfo(r.dtype).tiny
    return torch.where(total >= tiny, r / total.clamp_min(tiny), p)


def draw_uniforms(k: int, generator: torch.Generator | None, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The random numbers ``verify`` uses for one block of k drafted tokens, in the order it draws them: [k] float32
    acceptance uniforms (none when k = 0), then [1] float64 for the token sampled after the block. Drawing them per
    row from the row's own generator lets rows with different generators (seeded requests) be verified together."""
    u = torch.rand(k, generator=generator, device=device) if k else torch.empty(0, device=device)
    return u, torch.rand(1, generator=generator, device=device, dtype=torch.float64)


def verify(
    p: torch.Tensor,
    q: torch.Tensor,
    draft_tokens: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    lengths: torch.Tensor | None = None,
    uniforms: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling of one block (or of a batch of blocks: leading dims ``...``).

    p: [..., k+1, V] target probs at each drafted position and the bonus position; q: [..., k, V] draft probs the
    tokens were drawn from; draft_tokens: [..., k]. Token i is accepted with probability min(1, p(x_i) / q(x_i)); at
    the first rejection the next token is drawn from residual(p, q); if all k are accepted it is drawn from p[k] (the
    bonus token). Returns (n_accepted, next_token), each [...] (0-d for one block), on the device: the emitted tokens
    are draft_tokens[:n] + [next_token].

    Blocks of different lengths padded to k: ``lengths`` [...] each block's own length (no position past it is
    accepted) and q zero past it (so the residual there is p: the bonus token). ``uniforms`` (u [..., k] float32,
    v [..., 1] float64): the random numbers to use (``draw_uniforms`` per block), else drawn from ``generator``.
    """
    k = draft_tokens.shape[-1]
    if uniforms is None:
        uniforms = (torch.rand(draft_tokens.shape, generator=generator, device=p.device) if k else None,
                    torch.rand((*p.shape[:-2], 1), generator=generator, device=p.device, dtype=torch.float64))
    u, v = uniforms
    if k == 0:
        return torch.zeros(p.shape[:-2], dtype=torch.long, device=p.device), sample(p[..., 0, :], u=v)
    idx = draft_tokens.unsqueeze(-1)
    px = p[..., :k, :].gather(-1, idx).squeeze(-1)
    qx = q[..., :k, :].gather(-1, idx).squeeze(-1)
    accepted = u * qx < px  # u < p/q without dividing by q
    if lengths is not None:
        accepted &= torch.arange(k, device=p.device) < lengths.unsqueeze(-1)
    n = torch.cumprod(accepted.long(), -1).sum(-1)
    # Row k of q is zero, so the residual there is p[k] itself: the bonus token needs no branch.
    q_ext = torch.cat([q[..., :k, :], torch.zeros_like(q[..., :1, :])], dim=-2)
    at = n[..., None, None].expand(*n.shape, 1, p.shape[-1])
    return n, sample(residual(p.gather(-2, at).squeeze(-2), q_ext.gather(-2, at).squeeze(-2)), u=v)


def verify_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                  lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: target_logits [..., k+1, V], draft_tokens [..., k] (``lengths`` [...]: blocks padded to
    k, as in ``verify``).

    Accept the longest prefix that equals the target's argmax; the next token is the target's argmax after it. This is
    ``verify`` with one-hot p and q, computed without building them.
    """
    k = draft_tokens.shape[-1]
    best = target_logits.argmax(-1)
    if k:
        match = best[..., :k] == draft_tokens
        if lengths is not None:
            match &= torch.arange(k, device=best.device) < lengths.unsqueeze(-1)
        n = torch.cumprod(match.long(), -1).sum(-1)
    else:
        n = torch.zeros(best.shape[:-1], dtype=torch.long, device=best.device)
    return n, best.gather(-1, n.unsqueeze(-1)).squeeze(-1)


def verify_tree_greedy(target_logits: torch.Tensor, tokens: torch.Tensor,
                       children: Sequence[Sequence[int]]) -> tuple[list[int], torch.Tensor]:
    """Greedy verification of a token tree: target_logits [N + 1, V] (column 0 the root, column j + 1 node j), tokens
    [N], ``children`` per column (``TokenTree.children``). From the root, move to the child whose token is the target's
    argmax, while there is one. Returns (the accepted path's nodes, the target's argmax after it). Reads the argmaxes
    and tokens back to the host once (the walk is sequential and a tree is small)."""
    best = target_logits.argmax(-1)
    host_best, host_tokens = best.tolist(), tokens.tolist()
    path, col = [], 0
    while True:
        nxt = next((c for c in children[col] if host_tokens[c] == host_best[col]), None)
        if nxt is None:
            return path, best[col]
        path.append(nxt)
        col = nxt + 1


def verify_tree(p: torch.Tensor, tokens: torch.Tensor, children: Sequence[Sequence[int]],
                q: torch.Tensor | None = None, generator: torch.Generator | None = None, *,
                uniforms: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[list[int], torch.Tensor]:
    """Multi-draft speculative sampling of a token tree (recursive rejection over siblings: SpecInfer, Miao et al.
    2024; EAGLE-2; vLLM's and SGLang's tree sampling).

    p [N + 1, V]: target probabilities at every column (0 the root, j + 1 node j); tokens [N]; ``children`` per column
    (``TokenTree.children``). At the current column (the root first), its children are tried in order: child x is
    accepted with probability min(1, p'(x) / q'(x)), where p' starts as the column's p and becomes residual(p', q')
    after each rejected sibling. On acceptance the walk moves to the child; when every child of a column is rejected
    (or it has none) the next token is drawn from p' there. Returns (the accepted path's nodes, the next token).

    ``q``: None when the tree is deterministic given the context (EAGLE-2's top-k growth): each candidate is then a
    proposal of probability one (q' the one-hot of x), so x is accepted with probability p'(x) and a rejection zeroes
    x in p' (SGLang's ``tree_speculative_sampling_target_only``): exact for any tree chosen without the target's
    randomness. Else q [N + 1, V]: the draft distribution at each column, from which that column's children were drawn
    independently (with replacement), q' = q at every try (SpecInfer). Each node has its own acceptance uniform
    (``uniforms``: u [N] float32, v [1] float64 as ``draw_uniforms(N)`` makes them, else drawn from ``generator``), so
    the draws do not depend on the walk. Reads one acceptance test per tried child back to the host."""
    n = tokens.shape[0]
    u, v = uniforms if uniforms is not None else draw_uniforms(n, generator, p.device)
    host_tokens, host_u = tokens.tolist(), u.tolist()
    path, col, pc = [], 0, p[0]
    while True:
        nxt = None
        for c in children[col]:
            x = host_tokens[c]
            qc = q[col] if q is not None else torch.nn.functional.one_hot(tokens[c], p.shape[-1]).to(pc.dtype)
            if host_u[c] * float(qc[x]) < float(pc[x]):
                nxt = c
                break
            pc = residual(pc, qc)
        if nxt is None:
            return path, sample(pc, u=v)
        path.append(nxt)
        col = nxt + 1
        pc = p[col]


def draft_stats(logits: torch.Tensor) -> torch.Tensor:
    """Raw (temperature 1) confidence of a draft distribution: logits [..., V] -> [..., 3] = (top-1 prob, entropy in
    nats, top-1 minus top-2 prob). These are the policy's confidence features, whatever the sampling settings."""
    return probs_stats(torch.softmax(logits.float(), dim=-1))


def probs_stats(probs: torch.Tensor) -> torch.Tensor:
    """``draft_stats`` of probabilities already made (the temperature-1 softmax of the draft's logits)."""
    top2 = torch.topk(probs, 2, dim=-1).values
    entropy = torch.special.entr(probs).sum(-1)  # 0 log 0 = 0: tokens a trimmed draft cannot propose
    return torch.stack([top2[..., 0], entropy, top2[..., 0] - top2[..., 1]], dim=-1)


def acceptance_stats(p: torch.Tensor, q: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Per drafted token: [k, 3] = (q(x), p(x), beta) where beta = sum_x min(p, q) is the expected acceptance of
    that position. p: [>=k, V], q: [k, V], tokens: [k]."""
    k = tokens.shape[0]
    idx = tokens.view(k, 1)
    qx = q[:k].gather(-1, idx).squeeze(-1)
    px = p[:k].gather(-1, idx).squeeze(-1)
    beta = torch.minimum(p[:k], q[:k]).sum(-1)
    return torch.stack([qx, px, beta], dim=-1)


def copy_acceptance_stats(p: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``acceptance_stats`` of a deterministic proposal (q the one-hot of its tokens): q(x) = 1 and beta =
    sum_x min(p, q) = p(x), read without building q. Same values, a gather instead of three [k, V] passes and a
    [k, V] one-hot: this runs once per copying row and step, and a gather's cost does not grow with the vocabulary."""
    k = tokens.shape[0]
    px = p[:k].gather(-1, tokens.view(k, 1)).squeeze(-1)
    return torch.stack([torch.ones_like(px), px, px], dim=-1)

"""Toy models behind the causal-LM interface the decoder uses, for exact distribution tests."""

import torch
from transformers import LlamaConfig


class Markov(torch.nn.Module):
    """An order-1 Markov chain: logits of the next token depend on the last token only. ``logp`` [vocab, out]: rows
    are log-probabilities over ``out`` tokens (fewer than the vocabulary for a trimmed-vocabulary draft)."""

    def __init__(self, logp: torch.Tensor):
        super().__init__()
        self.logp = torch.nn.Parameter(logp, requires_grad=False)
        self.head = torch.nn.Linear(1, logp.shape[1], bias=False)
        self.config = LlamaConfig(vocab_size=logp.shape[0], num_hidden_layers=1, max_position_embeddings=64)

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, cache=None, use_cache=True, logits_to_keep=1):
        class Out:
            logits = self.logp[input_ids[:, -logits_to_keep:]]

        return Out

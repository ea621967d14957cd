"""Choosing the next token from logits: greedy, temperature, top-k, top-p, per request in one batched pass.

Each row of the batch may have its own sampling parameters. The filters are applied to all rows at once on the
sorted logits; rows whose request has a ``seed`` draw from that request's own generator (so its samples do not
depend on its neighbours in the batch), the others share one generator.
"""

from typing import List, Optional, Sequence

import torch

from megatron.core.inference.sampling_params import SamplingParams


def filtered_probabilities(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Probabilities ``[b, v]`` after each row's temperature, top-k and top-p (rows must not be greedy)."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device, dtype=torch.float32)
    logits = logits.float() / temperature[:, None]
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    if not any(top_k) and not any(top_p):
        return torch.softmax(logits, dim=-1)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=device)[None, :]
    k = torch.tensor([k if k > 0 else logits.shape[-1] for k in top_k], device=device)
    remove = rank >= k[:, None]
    sorted_probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    p = torch.tensor([p if p > 0 else 1.0 for p in top_p], device=device)
    # Keep the smallest prefix whose mass reaches top_p: drop a token once the mass before it already does.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    remove = remove | (mass_before >= p[:, None])
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    filtered = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.softmax(filtered, dim=-1)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[Optional[torch.Generator]],
    shared_generator: Optional[torch.Generator],
    vocab_size: Optional[int] = None,
) -> torch.Tensor:
    """The next token of every row ``[b]`` of ``logits`` ``[b, v]``; ids ``>= vocab_size`` (padding of the
    model's vocabulary) are never chosen."""
    if vocab_size is not None and vocab_size < logits.shape[-1]:
        logits = logits[:, :vocab_size]
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if not random_rows:
        return tokens
    probs = filtered_probabilities(logits[random_rows], [params[i] for i in random_rows])
    own: List[int] = [j for j, i in enumerate(random_rows) if generators[i] is not None]
    shared = [j for j, i in enumerate(random_rows) if generators[i] is None]
    drawn = torch.empty(len(random_rows), dtype=tokens.dtype, device=tokens.device)
    for j in own:
        drawn[j] = torch.multinomial(probs[j], 1, generator=generators[random_rows[j]])[0]
    if shared:
        drawn[shared] = torch.multinomial(probs[shared], 1, generator=shared_generator)[:, 0]
    tokens[random_rows] = drawn
    return tokens

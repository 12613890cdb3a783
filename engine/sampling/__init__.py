"""From logits to tokens: the sampler, per-request logit edits, structured outputs (grammars,
their bounded compile worker) and prompt logprobs."""

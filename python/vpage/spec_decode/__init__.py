"""Speculative decoding, in one place (vLLM's ``spec_decode`` package).

Where each part runs:
- proposing: n-gram lookup is the C++ scheduler's (``ngram_proposer.cpp``), which also owns
  the draft slots of a plan and rolls rejected drafts back at commit; a draft model is
  proposed for by ``draft_proposer`` (the engine's side: which tokens the draft's KV cache
  lacks) and ``draft_runner`` (the worker's side: the draft model's forwards);
- verifying: ``verifier``, in the model runner, after the target's forward (the accepted
  count per sample travels back in ``ModelRunnerOutput``);
- counting: ``metrics``, in the engine.
"""

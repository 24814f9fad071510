"""Speculative decoding: proposers guess a decoding sequence's next tokens, and one engine step
verifies every sequence's guesses at once (`LLMEngine.step`).

A step feeds each decoding sequence its newest token followed by its draft tokens, samples a token
after each of them with the sequence's own sampler, and keeps the draft's longest prefix that agrees
with what was sampled, plus the token sampled after it. Every sampled token is drawn exactly as a
non-speculative step would draw it at that output position (the sampler's randomness depends on
(seed, position) alone), so the output is the one decoding without speculation gives, token for
token, greedy or sampled; speculation only changes how many steps it takes.

  proposer.py  the interface, and the proposer a deployment names
  suffix.py    the model-free proposer (SuffixDecoding)
  draft.py     a proposal (tokens, each prefix's estimated chance) and the record of how drafts fared
  sizing.py    how many draft tokens each sequence verifies in a step (SmartSpec's goodput)
  config.py    the settings
"""

"""Speculative decoding for the generation engine: drafters propose each row's next tokens (ngram.py:
prompt lookup; draft_model.py: a draft model), policy.py decides per step how many each row drafts from
measured step times and acceptance, speculator.py ties them to the running batch; the verify step is
engine/verify.py's."""

"""`make bench-peers`: our models next to the engines users pick for them, on the same weights.

llama.cpp for SmolLM2 (its own Q4_1 GGUF and an F32 GGUF of the same weights), CTranslate2 for the
translator (converted from our Marian export), ONNX Runtime for MiniLM + head (exported from our
model). The peers live in their own environment under .peers/ (env.py), never in the service's
dependencies; every conversion is checked against our outputs before anything is timed (convert.py);
each engine runs in its own process (worker.py) and the rounds alternate between them (bench.py).
"""

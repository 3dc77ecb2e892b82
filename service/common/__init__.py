"""Helpers both sides of the service use, the ingress (http/) and the model replicas (replica/,
engine/): so they import only what both sides may, never torch (the ingress's rule), FastAPI or Ray
(the replicas' rule). tests/service/test_layout.py holds them to it.

    documents.py    whole documents for translation: cut into sentences, put back together
    text_limits.py  the character cap on a text, checked before any tokenization
    tool_calls.py   tool calls in chat: the prompt format, parsing answers back, the call grammar
    streams.py      asyncio helpers for several streams read as one
"""

"""The systems the serving benchmark compares, each a subprocess serving HTTP on 127.0.0.1.

    ours         python -m service (Ray Serve, our models, dynamic and continuous batching)
    plain        FastAPI + uvicorn running transformers models per request, no batching
    serve_batch  Ray Serve's documented pattern: one deployment, @serve.batch, pad to the longest

All three answer the same routes for the benchmark (/v1/classify, /v1/translate, a completions route,
/readyz, /v1/models with batching counters) on the same weights. `launchers.SYSTEMS` maps a name to
the function that builds its command line.
"""

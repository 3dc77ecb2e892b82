"""Key/value caches: the interface (base.py), the dense cache with a row per sequence (dense.py), the
paged pool of blocks (paged.py), and an encoder-decoder's cross-attention keys and values (cross.py)."""

"""One-off experiments: scripts that measured one question once (most in one process, on the shipped
models or tiny ones), kept so their figures in docs/ can be rerun. Nothing of the benchmark harness
(loadtests/) imports them; they may import it. Each runs as `python -m loadtests.experiments.<name>`.
"""

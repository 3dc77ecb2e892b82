"""loadtests.experiments.step_files lists the files a decode step runs: on the native backend, the
executor and the native step, never the torch stacks."""

from __future__ import annotations

from tests.models.projections.test_quant import needs_kernels


@needs_kernels
def test_a_native_decode_step_runs_the_native_backend_not_the_stacks() -> None:
    from loadtests.experiments.step_files import step_files

    files, plan = step_files(tiny=True)
    assert "decode=native" in plan
    assert {"models/execution/executors.py", "models/execution/native.py", "service/engine/batch.py"} <= set(files)
    assert "models/stacks.py" not in files and "models/layers.py" not in files

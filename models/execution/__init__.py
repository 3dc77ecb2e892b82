"""How a model runs: its execution plan (plan.py), chosen once at load (planner.py), and the backends the
plan names, behind one executor per family (executors.py) that engines, searches and replicas call.

    plan.py       the plan's types: phase -> backend, detail, and why not each other backend
    planner.py    plan_model(model, execution, runtime) -> executor; PlanError for a backend that cannot run
    executors.py  EncoderExecutor, DecoderExecutor, Seq2SeqExecutor: one method per phase
    native.py     our C++ stack step (models/kernels/block_step.cpp) for an encoder pass or a decode step
    compiled.py   the blocks through torch.compile, warmed up at load
    graphs.py     decode steps as CUDA graphs, per bucket of rows x key blocks
The model's own forward (models/stacks.py, plain torch) is the torch backend and the reference the
others are tested against.
"""

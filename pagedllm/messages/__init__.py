"""Plain-data contracts between the layers: the bottom floor of the import graph.

``engine_core`` (front end <-> EngineCore requests, outputs, events, scheduler stats),
``sched_output`` (scheduler -> model runner) and ``runner_output`` (model runner ->
scheduler). Every layer that exchanges them imports them from here; this package imports
nothing from pagedllm except the other plain-data modules (``sampling_params``), and no
torch, so the messages cross process boundaries (msgspec) and the torch-free ``core``
can use them.
"""

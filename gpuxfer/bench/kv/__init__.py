"""``gpuxfer bench kv``: the KV-cache hand-off benchmark.

* :mod:`.cli` -- the command line (options, ``--plan-only``);
* :mod:`.grid` -- the sweep grid (workloads x pages x ISLs x batches, shed by budgets);
* :mod:`.runner` -- the measured sweep: two processes, every engine, every byte verified;
* :mod:`.report` -- the nccl-tests-style table, JSON document and plots;
* :mod:`.collectivex` -- the CollectiveX suite's grid, verification and documents.
"""

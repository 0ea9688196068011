"""``gpuxfer bench kv``: the KV-cache hand-off benchmark.

* :mod:`.cli` -- the command line (``add_arguments``, ``run``, ``--plan-only``);
* :mod:`.options` -- every option parsed and checked once, defaults resolved in one place;
* :mod:`.grid` -- the sweep grid (workloads x pages x ISLs x batches, shed by budgets);
* :mod:`.runconfig` -- the run's configuration (:class:`~.runconfig.RunConfig`), what each worker is handed;
* :mod:`.runner` -- the configuration built from the command line, the two processes' launch (spawned or torchrun);
* :mod:`.worker` -- one process: setup, the sweep (every engine, every byte verified), teardown;
* :mod:`.checks` -- pattern fill, verification, fault injection;
* :mod:`.report` -- the table, summary, JSON document and plots;
* :mod:`.collectivex` -- the CollectiveX suite's grid, verification and documents;
* :mod:`.model` -- the workload model (workloads, pool layouts, block tables, plans);
* :mod:`.engines` -- the engines measured on the same bursts (their registry, the optional libraries' adapters).
"""

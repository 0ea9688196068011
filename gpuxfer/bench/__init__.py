"""The benchmarks: ``gpuxfer bench kv|pp|kernels``.

A wing of its own: it imports the product (:mod:`gpuxfer.kv`, :mod:`gpuxfer.pp`,
:mod:`gpuxfer.kernels`, :mod:`gpuxfer.platforms`) and nothing in the product imports
it. Each command module exposes ``add_arguments(parser)`` and ``run(args) -> int``
(the exit code), wired up by :mod:`gpuxfer.cli`:

* :mod:`gpuxfer.bench.kv` -- the KV-cache hand-off sweep (grid, two-process runner,
  report, the CollectiveX suite);
* :mod:`gpuxfer.bench.pp` -- the pipeline-parallel stage hand-off;
* :mod:`gpuxfer.bench.kernels` -- the Triton copy kernels against their ceilings;
* :mod:`gpuxfer.bench.report` -- the one nccl-tests-style reporter (table, footer, JSON, exit code);
* :mod:`gpuxfer.bench.timing` -- the one clock and the statistics of its samples;
* :mod:`gpuxfer.bench.cliutil` -- the options and output folders every command shares.
"""

"""What runs in each engine step: the scheduler picks the chunks, `BatchGenerator` runs the step
and samples each sequence's token; its knobs can be changed between steps (tuning_state).

The one generation loop: the worker's service, the CLI, the benchmarks and the golden tests all
drive `BatchGenerator` (`generate_one` for a single request).
"""

"""The speed policy: the knobs that change only how fast a decode runs, never its law (`control`:
gamma and the draft width per iteration), the cost model that chooses them from measured costs
and pass rates (`cost_model`), and whole-iteration timing that calibrates it (`iteration_timer`)."""

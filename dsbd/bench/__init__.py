"""The `dsbd bench` benchmarks beside the decode harness, one module per subcommand.

    dsbd bench decode ...   every decoder side by side in one process (dsbd/bench_command.py,
                            the harness dsbd/bench/decode); `dsbd bench ...` is the same
    dsbd bench serve        the served path: against the in-process engine, DSBD against beam
    dsbd bench batch        batched decodes against one at a time (the `dsbd batch` job or the
                            engine's lockstep batching)
    dsbd bench load         N clients against a running server: latency, errors, memory
    dsbd bench chaos        replicas SIGKILLed under load: failures, recoveries, seeded tokens
    dsbd bench soak         steady load for half an hour: every server process's memory growth

Each module has `add_arguments(parser)` (its flags) and `run(args)` (exit status; 2 for values
the flags' types cannot check, naming the flag). Their top-level imports stay light (no Ray, no
server, no HTTP client): `dsbd --help` registers every subcommand's flags, and a benchmark imports
what it drives only once it runs. Servers are started by dsbd/server_process.py, the launcher the
tests share. Each benchmark writes one current result under benchmarks/results/ (its `--out`);
earlier results live in git history.
"""

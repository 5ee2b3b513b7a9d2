"""The deployments that hold models: Draft and Verifier (`draft`, `verifier`, over
`model_replica` and `continuous_batch`), what a replica reports of its memory (`memory`), a
tensor-parallel verifier's rank group (`tp_group`), session-affine request routing (`affinity`)
and the replicas' allocator (`allocator`). Imports only the foundation (messages, faults,
observability): nothing of the decode loop or the HTTP side."""

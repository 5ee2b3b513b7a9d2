"""The deployments that hold models: Draft and Verifier (`draft`, `verifier`, over
`model_replica` and `continuous_batch`), a tensor-parallel verifier's rank group (`tp_group`),
session-affine request routing (`affinity`) and the replicas' allocator (`allocator`)."""

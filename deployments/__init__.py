"""Ray Serve deployments: the application that serves `dsbd_core`'s decoders over HTTP.

By floor, each importing only its own floor and those below (tests/tools/test_layers.py checks):

    app, llm_serving, local_serve the application built from a config; `dsbd serve` on a local Ray
    batch_job                     `dsbd batch`: the Ray Data job (uses the API's request fields)
    api                           the HTTP ingress: OpenAI models, limits, admission, streaming
    decode                        the Router / Pair decode loop, sessions, the session registry
    replicas                      the Draft and Verifier model replicas, their memory and batching
    messages, faults, observability, gcs_ft, local_ray, autoscaling   what every floor shares

Decode in-process without Ray with `dsbd_core` (`dsbd generate`, `dsbd_core.generate`).
"""

"""Ray Serve deployments (router, draft, verifier, width controller).

Nothing here yet: they arrive with issue 4. Until then decode in-process with `dsbd_core`
(`dsbd generate`, or `dsbd_core.generate` from Python).
"""

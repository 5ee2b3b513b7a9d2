"""The decode loop's side of the server: the Router deployment (`router`) and the co-located Pair
(`pair`, `local_handles`), what they drive per request (`session`, `calibration`, `state`), the
ingress's client of them (`client`) and the SessionRegistry deployment (`session_registry`).
Imports replicas and the foundation below it, never the HTTP side (`api`)."""

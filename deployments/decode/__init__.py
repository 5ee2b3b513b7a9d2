"""The decode loop's side of the server: the Router deployment (`router`) and what it drives per
request (`session`, `calibration`, `state`, `limits`), the ingress's client of it (`client`) and
the WidthController deployment (`width_controller`)."""

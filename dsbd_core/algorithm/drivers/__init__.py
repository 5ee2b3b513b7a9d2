"""What drives the iteration over a whole decode: the one decode loop (`loop`), the public
`generate`/`generate_batch` (`decoders`), many sessions in lockstep (`lockstep`) or through one
shared forward per round (`session_batch`), and the bit-for-bit rebuild of a lost KV cache by
re-running past iterations (`replay`)."""

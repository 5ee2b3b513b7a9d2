"""`dsbd batch`: a Ray Data job that decodes files of prompts (`job`), its input (`inputs`,
`rows`, `keys`, `source`), its decoding actors (`decoder`) and its output (`output`, `sink`)."""

"""What a decode carries and returns per sequence: the state between steps, the forest and the
verified outcome (`state`), beams' log-probabilities (`logprobs`, `prompt_logprobs`), the result
(`result`), stop rules (`stops` on token ids, `stop_text` on the text) and the penalties that
reshape the law (`penalties`)."""

"""The HTTP side of the server: the Ingress deployment (`ingress`, `served_model`), its OpenAI
request and response models (`models`, `responses`, `streaming`, `stop_fields`,
`penalty_fields`), a request's limits (`limits`), errors, API keys and admission by memory
(`admission`). Sits above the decode loop and the replicas it reaches through handles."""

"""The HTTP side of the server: the Ingress deployment (`ingress`), its OpenAI request and
response models (`models`, `responses`, `streaming`), errors, API keys and admission."""

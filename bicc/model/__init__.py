"""The model and how it scores tokens: loading the policy and its tokenizer (load, tokenizer, gguf), LoRA adapters on
it (lora), per-token log-probs (logprobs) through a chunked output head (head). Imports ``bicc.machine``; imported by
method and above."""

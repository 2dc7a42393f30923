"""Model definitions that run an engine bundle (Llama family: Llama, Mistral, Qwen2) and their layers."""

"""Model implementations. Only the Llama family for now (Llama 2/3, Qwen2, Mistral, SmolLM)."""

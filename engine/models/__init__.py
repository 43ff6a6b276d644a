"""Model definitions: one decoder-only transformer family covering Llama, Qwen2, Qwen3 and MoE variants."""

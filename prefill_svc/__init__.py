"""Prefill service: the engine in the prefill role. Computes prompts, samples the first token, and holds
the prompt's KV blocks under a lease until a decode worker has pulled them over NIXL."""

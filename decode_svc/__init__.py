"""Decode service: the engine in the decode role. Pulls a prefill worker's KV blocks over NIXL (or
prefills locally when asked), joins the request to its continuous batch and streams tokens back."""

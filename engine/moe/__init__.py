"""Mixture-of-experts: routing over physical experts, per-expert load counters, token dispatch backends."""

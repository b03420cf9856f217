"""Causal Wan2.1 DiT (CausVid, Causal Forcing)."""

"""Audio: G.711 tables, the streaming 8 → 16 kHz upsampler, and the per-call media core."""

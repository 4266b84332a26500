"""Hydra plugins of pnpscale: the sweeper (one sweep per folder) and the launchers (validate every point first)."""

"""Hydra plugins of pnpscale: the sweeps/ search path and the launchers (validate every point first)."""

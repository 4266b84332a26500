"""Stage 2, inside one rank: build the problem and the distributed solver, run and profile the iterations.

* :mod:`~pnpscale.rank.problems`: the problem registry (2D, 3D, ...), ground truth, operators;
* :mod:`~pnpscale.rank.solver`: deepinv's distributed PnP solver (inference and training modes);
* :mod:`~pnpscale.rank.profiling`: the torch.profiler session and its events;
* :mod:`~pnpscale.rank.worker`: a rank's main (process group, iterations, sections, report to rank 0);
* :mod:`~pnpscale.rank.assignment`: who holds which operator and tile (pure).
"""

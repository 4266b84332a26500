"""Stage 2 (floor 2), inside one rank: build the problem and the distributed solver, run and profile the iterations.

* :mod:`~pnpscale.rank.problems`: the problem registry (2D, 3D, CT, ...), ground truth, operators;
* :mod:`~pnpscale.rank.solver`: deepinv's distributed PnP solver (the :class:`~pnpscale.rank.solver.Solver`
  base and the inference and training modes);
* :mod:`~pnpscale.rank.denoiser`: the tiled DRUNet and its all_reduce / all_gather reconciliation;
* :mod:`~pnpscale.rank.pipeline`: ``solver.overlap=pipelined``, the gradient's all_reduce and the denoiser
  overlapped band by band (async chunks, autograd-aware);
* :mod:`~pnpscale.rank.gradient`: ``solver.gradient_collective=reduce_scatter``, the gradient summed over ranks
  only where each rank's tiles read it (reduce-scatter over the cores, all_gather of the boundaries);
* :mod:`~pnpscale.rank.profiling`: the torch.profiler session and its events;
* :mod:`~pnpscale.rank.worker`: a rank's main (set up, measure, its tables gathered on rank 0, which commits);
* :mod:`~pnpscale.rank.process`: a rank's process: tied to its launcher, its environment;
* :mod:`~pnpscale.rank.gpus`: which GPU a rank uses (bound before its first CUDA call, checked after);
* :mod:`~pnpscale.rank.group`: the ranks' process group, the backend chosen from every rank's GPU, NCCL's log;
* :mod:`~pnpscale.rank.loop`: the measured loop (sections under one profiler, injections, the heartbeat);
* :mod:`~pnpscale.rank.forkserver`: the forkserver's first preload: it ends with the launcher, quiet Ctrl-C;
* :mod:`~pnpscale.rank.preloaded`: the forkserver's last preload (hands the launcher watch to its loop);
* :mod:`~pnpscale.rank.commit`: rank 0's last step: decompose and write the run folder;
* :mod:`~pnpscale.rank.assignment`: who holds which operator and tile (pure).
"""

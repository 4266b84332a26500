"""deepinv.distributed PnP solver, exposed as named sections.

Inference (one iteration = two sections)::

    gradient:  x <- x - gamma * sum_i A_i^T (A_i x - y_i)     (DistributedDataFidelity.grad)
    denoiser:  x <- D_sigma(x)                                 (DRUNet on overlapping tiles)

Each section ends with one image-sized ``all_reduce`` (deepinv's reconciliation of ranks; with
``solver.denoiser_collective=all_gather`` the denoiser's is an ``all_gather`` of the tile cores,
see :mod:`pnpscale.rank.denoiser`); the gradient also runs deepinv's three tiny shape/flag
collectives. ``gamma = stepsize / L`` with ``L`` the bound of :class:`~pnpscale.rank.problems.ProblemData`.

Training (one step = two sections, see :class:`TrainingSolver`)::

    forward:   K unrolled PnP iterations from the back-projection, then the MSE loss
    backward:  loss.backward() (autograd-aware collectives, denoiser weight-gradient all_reduce)

The optimizer step runs outside the sections.

With ``solver.overlap=pipelined`` (:mod:`pnpscale.rank.pipeline`) the gradient section computes each rank's
local sum only; the gradient's all_reduce, split into row bands and issued asynchronously, opens the denoiser
section, whose tiles start as the bands they read arrive and whose reconciliation is issued band by band.

With ``solver.gradient_collective=reduce_scatter`` (:mod:`pnpscale.rank.gradient`) the gradient section's
image-sized all_reduce becomes a reduce-scatter over the ranks' tile cores and an all_gather of their boundaries:
each rank holds the sum only where its tiles' windows read it (the denoiser reads nothing else).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from pnpscale.core.config import GRADIENT_COLLECTIVES, ConfigError, RunSpec
from pnpscale.core.plugins import Rule, check_params, params_values, resolve_impl
from pnpscale.rank.denoiser import tiled_denoiser
from pnpscale.rank.gradient import WindowedGradient
from pnpscale.rank.pipeline import PipelinedStep
from pnpscale.rank.problems import ProblemData, make_problem, measurements

Section = tuple[str, Callable[[], None]]


def build_denoiser(spec: RunSpec, channels: int) -> torch.nn.Module:
    """DRUNet with ``pretrained=None`` and the spec's widths, weights from ``spec.seed``.

    Built on the CPU under a fixed seed, so every rank holds identical weights.
    """
    from deepinv.models import DRUNet

    dims = spec.dims
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        return DRUNet(
            in_channels=channels,
            out_channels=channels,
            nc=tuple(spec.sizes["nc"]),
            nb=spec.sizes["nb"],
            pretrained=None,
            device="cpu",
            dim=dims,
        )


def weights_digest(net: torch.nn.Module) -> str:
    """SHA-256 of the module's parameters (exact bytes, in order): equal digests = identical weights."""
    import hashlib

    h = hashlib.sha256()
    for p in net.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


class Solver(ABC):
    """The public base of a mode: problem, distributed physics, data fidelity and tiled denoiser.

    A mode is a subclass naming its :attr:`SECTIONS` (which ``conf/mode/<name>.yaml`` repeats
    for the Hydra parent, and :func:`make_solver` checks), returning them from :meth:`sections` as
    ``(name, callable)`` pairs, and implementing :meth:`after_step`, :meth:`summary` and :meth:`result`.
    The mode's own parameters (``mode.params.*``) are the fields of its :attr:`params` dataclass (with
    their defaults, which its YAML repeats) and :attr:`rules`, checked before a rank starts
    (:func:`check_mode`). The rank (:func:`pnpscale.rank.worker.rank_main`) knows only this interface.

    Args:
        spec: the run's spec.
        ctx: deepinv's ``DistributedContext`` of this rank.
        train: whether the denoiser's weights are trained (else frozen, eval mode).
    """

    SECTIONS: tuple[str, ...] = ()
    #: The mode's own keys under ``mode.params``: a dataclass, ``None`` for a mode with none.
    params: ClassVar[type | None] = None
    #: Value rules of those keys (``"lr" -> (ok, allowed)``).
    rules: ClassVar[Mapping[str, Rule]] = {}

    @property
    def settings(self) -> Any:
        """``mode.params`` as an instance of :attr:`params` (the spec's values over the defaults)."""
        return params_values(type(self).params, self.spec.mode_params)

    def __init__(self, spec: RunSpec, ctx: Any, *, train: bool = False) -> None:
        from deepinv.distributed import distribute
        from deepinv.distributed.strategies.distributed_strategies import TilingStrategy
        from deepinv.optim.data_fidelity import L2

        self.spec, self.ctx = spec, ctx
        self.problem: ProblemData = make_problem(spec).build(ctx.device)
        x_true = self.problem.x_true
        n_ops = self.problem.num_operators
        self.physics = distribute(self.problem.factory, ctx, num_operators=n_ops, type_object="linear_physics")
        self.fidelity = distribute(lambda i, d, kw: L2(), ctx, num_operators=n_ops, type_object="data_fidelity")
        self.y = measurements(
            self.problem, self.physics.local_physics, self.physics.local_indexes, spec.noise_sigma, spec.seed
        )
        dims = spec.dims
        tiling_dims = tuple(range(-dims, 0))
        strategy = TilingStrategy(
            x_true.shape,
            tiling_dims=tiling_dims,
            patch_size=spec.sizes["patch_size"],
            overlap=spec.sizes["overlap"],
        )
        net = build_denoiser(spec, x_true.shape[1])
        if not train:
            net.requires_grad_(False).eval()
        self.net = net
        self.denoiser: Any = tiled_denoiser(  # deepinv DistributedProcessing (or its all_gather twin)
            net,
            ctx,
            strategy,
            collective=spec.denoiser_collective,
            max_batch_size=spec.sizes["max_batch_size"],
        )
        self.num_tiles = strategy.get_num_patches()
        self.pipeline: PipelinedStep | None = None
        if spec.overlap == "pipelined":
            if spec.denoiser_collective != "all_reduce":
                raise ConfigError("solver.overlap", spec.overlap, "needs solver.denoiser_collective=all_reduce")
            self.pipeline = PipelinedStep(self.denoiser, spec.overlap_chunks)
        self.windowed: WindowedGradient | None = None
        if spec.gradient_collective not in GRADIENT_COLLECTIVES:
            raise ConfigError(
                "solver.gradient_collective",
                spec.gradient_collective,
                "allowed values: " + ", ".join(GRADIENT_COLLECTIVES),
            )
        if spec.gradient_collective == "reduce_scatter":
            if self.pipeline is not None:
                raise ConfigError("solver.gradient_collective", spec.gradient_collective, "needs solver.overlap=none")
            self.windowed = WindowedGradient(strategy)
            if self.windowed.active and (self.windowed.rank, self.windowed.layout.world) != (ctx.rank, ctx.world_size):
                raise RuntimeError(
                    f"rank {ctx.rank}: the process group's rank/world ({self.windowed.rank}/"
                    f"{self.windowed.layout.world}) differ from deepinv's tile assignment ({ctx.rank}/{ctx.world_size})"
                )
        self.gamma = spec.stepsize / self.problem.lipschitz
        self.sigma = float(spec.denoiser_sigma)

    def data_gradient(self, x: torch.Tensor) -> torch.Tensor:
        """``Σ_i A_iᵀ(A_i x − y_i)`` summed over ranks: deepinv's (an image-sized all_reduce), or with
        ``solver.gradient_collective=reduce_scatter`` only where this rank's tiles read it (zeros elsewhere)."""
        if self.windowed is None:
            return self.fidelity.grad(x, self.y, self.physics)
        return self.windowed(self.fidelity.grad(x, self.y, self.physics, gather=False))

    def backprojection(self) -> torch.Tensor:
        """``x0 = A^T y / L`` (one image-sized all_reduce; run outside the sections)."""
        return self.physics.A_adjoint(self.y) / self.problem.lipschitz

    @abstractmethod
    def sections(self) -> list[Section]:
        """The measured sections of one iteration, in order: ``(name, callable)``, names = :attr:`SECTIONS`."""

    @abstractmethod
    def after_step(self) -> None:
        """Work between iterations, outside every section (e.g. the optimizer step)."""

    @abstractmethod
    def summary(self) -> dict[str, Any]:
        """``run.json``'s ``solver`` block of this rank (at least ``weights_sha256``)."""

    @abstractmethod
    def result(self) -> torch.Tensor:
        """The reconstruction after the last iteration."""


class InferenceSolver(Solver):
    """The PnP loop with fixed denoiser weights: sections ``gradient`` then ``denoiser``."""

    SECTIONS = ("gradient", "denoiser")

    def __init__(self, spec: RunSpec, ctx: Any) -> None:
        super().__init__(spec, ctx, train=False)
        with torch.no_grad():
            self.x = self.backprojection()
        self.g_local: torch.Tensor | None = None

    def _gradient(self) -> None:
        with torch.no_grad():
            if self.pipeline is not None:  # the local sum only: its all_reduce opens the denoiser section
                self.g_local = self.fidelity.grad(self.x, self.y, self.physics, gather=False)
                return
            g = self.data_gradient(self.x)
            self.x = self.x - self.gamma * g

    def _denoise(self) -> None:
        with torch.no_grad():
            if self.pipeline is not None:
                assert self.g_local is not None
                chunks, pending = self.pipeline.issue_gradient(self.g_local)
                self.x = self.pipeline.denoise(self.x, self.gamma, chunks, pending, self.sigma)
                self.g_local = None
                return
            self.x = self.denoiser(self.x, self.sigma)

    def sections(self) -> list[Section]:
        return [("gradient", self._gradient), ("denoiser", self._denoise)]

    def after_step(self) -> None:
        """Nothing happens between inference iterations."""

    def summary(self) -> dict[str, Any]:
        """Digest of the (fixed) denoiser weights."""
        return {"weights_sha256": weights_digest(self.net)}

    def result(self) -> torch.Tensor:
        return self.x


@dataclass
class TrainingParams:
    """``mode.params`` of training.

    Attributes:
        lr: Adam's learning rate (> 0).
        train_stepsize: also learn the step size ``gamma`` (its log).
    """

    lr: float = 1e-4
    train_stepsize: bool = False


class TrainingSolver(Solver):
    """K unrolled PnP iterations trained as one network: sections ``forward`` then ``backward``.

    Loss: mean squared error against the ground truth. Optimizer: Adam on the denoiser weights, learning
    rate ``mode.params.lr`` (and on the step size ``gamma`` when ``mode.params.train_stepsize``); it steps
    outside the sections.
    deepinv's autograd-aware collectives carry gradients across ranks, and its parameter sync
    all-reduces (averages) the denoiser's weight gradients at the end of backward, so weights stay
    identical on every rank.
    """

    SECTIONS = ("forward", "backward")
    params = TrainingParams
    rules = {
        "lr": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0, "must be a number > 0"),
    }

    def __init__(self, spec: RunSpec, ctx: Any) -> None:
        super().__init__(spec, ctx, train=True)
        from deepinv.distributed import distribute

        self.unroll = int(spec.sizes["unroll"])
        with torch.no_grad():
            self.x0 = self.backprojection()
        self.log_gamma = torch.nn.Parameter(torch.tensor(float(torch.log(torch.tensor(self.gamma))), device=ctx.device))
        params = list(self.net.parameters())
        settings = self.settings
        if settings.train_stepsize:
            self.log_gamma = distribute(self.log_gamma, ctx, type_object="parameters")
            params.append(self.log_gamma)
        else:
            self.log_gamma.requires_grad_(False)
        self.optimizer = torch.optim.Adam(params, lr=float(settings.lr))
        self.loss: torch.Tensor | None = None
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.x: torch.Tensor = self.x0

    def _forward(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        gamma = self.log_gamma.exp()
        x = self.x0
        for _ in range(self.unroll):
            if self.pipeline is not None:
                g_local = self.fidelity.grad(x, self.y, self.physics, gather=False)
                chunks, pending = self.pipeline.issue_gradient(g_local)
                x = self.pipeline.denoise(x, gamma, chunks, pending, self.sigma)
                continue
            g = self.data_gradient(x)
            x = self.denoiser(x - gamma * g, self.sigma)
        self.x = x
        self.loss = torch.mean((x - self.problem.x_true) ** 2)

    def _backward(self) -> None:
        assert self.loss is not None
        self.loss.backward()

    def sections(self) -> list[Section]:
        return [("forward", self._forward), ("backward", self._backward)]

    def after_step(self) -> None:
        """Optimizer step (outside the sections); records the loss and the weight-gradient norm."""
        assert self.loss is not None
        self.losses.append(float(self.loss.detach()))
        self.grad_norms.append(self.grad_norm())
        self.optimizer.step()
        self.loss = None

    def summary(self) -> dict[str, Any]:
        """Per-step loss and denoiser weight-gradient norm, and a digest of the final weights."""
        return {
            "losses": list(self.losses),
            "grad_norms": list(self.grad_norms),
            "weights_sha256": weights_digest(self.net),
        }

    def result(self) -> torch.Tensor:
        return self.x.detach()

    def grad_norm(self) -> float:
        """Euclidean norm of the denoiser weight gradient (after a backward)."""
        sq = [p.grad.detach().pow(2).sum() for p in self.net.parameters() if p.grad is not None]
        return float(torch.stack(sq).sum().sqrt()) if sq else 0.0


def check_mode(spec: RunSpec) -> type[Solver]:
    """The solver class of ``spec.mode`` (``conf/mode/<name>.yaml``'s ``impl``), checked against the spec:
    its sections and its own parameters (``mode.params``). Run before any rank starts, and by each rank.

    Raises:
        pnpscale.core.config.ConfigError: ``mode.impl`` is not a :class:`Solver` subclass, its sections
            differ from ``mode.sections``, or a ``mode.params`` key is unknown to it, of the wrong type or
            outside its rule (:func:`pnpscale.core.plugins.check_params`).
    """
    cls = resolve_impl("mode.impl", spec.mode_impl, Solver)
    if tuple(cls.SECTIONS) != tuple(spec.sections):
        raise ConfigError("mode.sections", list(spec.sections), f"{spec.mode_impl} runs sections {list(cls.SECTIONS)}")
    check_params("mode.params", cls.params, cls.rules, spec.mode_params, f"mode={spec.mode}")
    return cls


def make_solver(spec: RunSpec, ctx: Any) -> Solver:
    """The solver of ``spec.mode``, checked (:func:`check_mode`) and built on this rank.

    Raises:
        pnpscale.core.config.ConfigError: see :func:`check_mode`.
    """
    return check_mode(spec)(spec, ctx)

"""Muon for the block matrices, AdamW for the rest, with schedules (model.schedule) keyed to training progress.

Progress is charged seconds / budget, never a step count: a trial that runs slower gets fewer steps
but the same shape of schedule, which is what a time-budgeted competition rewards. Per-step scalars
(learning rate, momentum, weight decay) live in 0-dim tensors that are filled in place, so a compiled
step sees the same graph every time.

Each optimiser's update of one parameter is a plain function (:func:`muon_update`, :func:`adamw_update`),
compiled as the public recipe compiles its fused steps (``torch.compile(fullgraph=True, dynamic=False)``):
one small graph per distinct parameter shape, compiled at the first step (start-up, not charged), rather
than one graph unrolled over every parameter. Eager and compiled run the same function.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model import schedule
from model.config import OptimConfig

# Polar Express coefficients for five quintic iterations, from Amsel et al., "The Polar Express:
# Optimal Matrix Sign Methods and Their Application to the Muon Algorithm" (arXiv:2505.16932),
# computed with a 2e-2 safety factor; the input is normalised by (1 + 2e-2) times its norm.
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
POLAR_SAFETY = 1.02


def orthogonalize(g: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Approximate the orthogonal polar factor U V^T of a matrix: all singular values pushed near 1."""
    x = g.to(dtype)
    transposed = x.size(-2) > x.size(-1)
    if transposed:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) * POLAR_SAFETY + 1e-7)
    for a, b, c in POLAR_EXPRESS:
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    if transposed:
        x = x.mT
    return x.to(g.dtype)


def muon_update(p: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, second: torch.Tensor | None,
                lr: torch.Tensor, momentum: torch.Tensor, wd: torch.Tensor, beta2: torch.Tensor | None,
                nesterov: bool, cautious_wd: bool, ortho_dtype: torch.dtype) -> None:
    """Muon's step in place for one matrix (rows, cols) or a stack of same-shape ones (K, rows, cols), each on its
    own: momentum, Polar Express, NorMuon (``second`` and ``beta2`` given), shape-scaled lr, decoupled or cautious
    weight decay."""
    buf.lerp_(grad, 1 - momentum)
    g = grad.lerp(buf, momentum) if nesterov else buf
    update = orthogonalize(g, ortho_dtype)
    if second is not None and beta2 is not None:
        update = normuon(update, second, beta2)
    step_lr = lr * max(1.0, p.size(-2) / p.size(-1)) ** 0.5
    if cautious_wd:
        mask = (update * p > 0).to(p.dtype)
        p.sub_(p * mask * (step_lr * wd))
    else:
        p.mul_(1 - step_lr * wd)
    p.sub_(update * step_lr)


def normuon(update: torch.Tensor, second: torch.Tensor, beta2: torch.Tensor) -> torch.Tensor:
    """NorMuon: divide each row (column) by the root of its running mean square, keep each matrix's norm."""
    dim = -1 if update.size(-2) >= update.size(-1) else -2
    mean_sq = update.float().square().mean(dim=dim, keepdim=True)
    second.lerp_(mean_sq, 1 - beta2)
    scale = second.clamp_min(1e-10).rsqrt()
    before = mean_sq.sum(dim=(-2, -1), keepdim=True).sqrt()
    after = (mean_sq * scale.square()).sum(dim=(-2, -1), keepdim=True).sqrt()
    return update * (scale * (before / after.clamp_min(1e-10))).to(update.dtype)


def adamw_update(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 step: torch.Tensor, lr: torch.Tensor, beta1: float, beta2: float, eps: float, wd: torch.Tensor,
                 decay: bool) -> None:
    """One tensor's AdamW step in place; ``step`` a 0-dim count, bias corrections folded into 0-dim factors."""
    step += 1
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (exp_avg_sq / (1 - beta2 ** step)).sqrt_().add_(eps)
    if decay:
        p.mul_(1 - lr * wd)
    p.sub_(exp_avg.div(denom).mul_(lr / (1 - beta1 ** step)))


def compiled(fn, backend: str = "inductor"):
    """``fn`` compiled whole (a graph break is an error) for fixed shapes: one graph per parameter shape."""
    options = {"emulate_precision_casts": True} if backend == "inductor" else None
    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=False, options=options)


class Muon(torch.optim.Optimizer):
    """Momentum orthogonalised by Polar Express, for 2-D weights whose gradients are already reduced.

    The step (update and weight decay alike) is scaled by sqrt(max(1, rows / cols)) so tall and wide matrices
    move alike. With NorMuon (beta2 given, arXiv:2510.05491) the orthogonalised update is rescaled per row, or
    per column for a wide matrix, by the inverse root of an EMA of its mean square, then brought back to its
    own Frobenius norm. Weight decay is decoupled, or cautious (applied only where update and weight agree in
    sign, arXiv:2510.12402).

    Same-shape matrices are stepped as one stack (K, rows, cols), as the public recipe steps them: one call, and
    compiled one graph, per shape. Their momentum and second moments live stacked; ``state[p]`` holds views.
    """

    def __init__(
        self,
        params,
        lr: torch.Tensor,
        momentum: torch.Tensor,
        weight_decay: torch.Tensor,
        nesterov: bool = True,
        cautious_wd: bool = True,
        ortho_dtype: torch.dtype = torch.bfloat16,
        beta2: torch.Tensor | None = None,
    ) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))
        self.nesterov = nesterov
        self.cautious_wd = cautious_wd
        self.ortho_dtype = ortho_dtype
        self.beta2 = beta2
        self.update = muon_update  # compile() swaps in the compiled function
        self.stacks: list[list[Stack]] = []  # per param group
        for group in self.param_groups:
            by_shape: dict[tuple, list[torch.nn.Parameter]] = {}
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon takes 2-D matrices only, got shape {tuple(p.shape)}")
                by_shape.setdefault((tuple(p.shape), p.dtype, p.device), []).append(p)
            self.stacks.append([Stack.of(same, beta2 is not None) for same in by_shape.values()])
            for stack in self.stacks[-1]:  # state from the start: a compiled step sees the same structure each time
                for i, p in enumerate(stack.params):
                    self.state[p]["momentum_buffer"] = stack.momentum[i]
                    if stack.second is not None:
                        self.state[p]["second_moment"] = stack.second[i]

    @torch.no_grad()
    def step(self) -> None:
        for group, stacks in zip(self.param_groups, self.stacks, strict=True):
            lr, mom, wd = group["lr"], group["momentum"], group["weight_decay"]
            for stack in stacks:
                if all(p.grad is not None for p in stack.params):
                    weights = torch.stack([p.detach() for p in stack.params])
                    self.update(weights, torch.stack([p.grad for p in stack.params]), stack.momentum, stack.second,
                                lr, mom, wd, self.beta2, self.nesterov, self.cautious_wd, self.ortho_dtype)
                    torch._foreach_copy_([p.detach() for p in stack.params], list(weights.unbind(0)))
                    continue
                for i, p in enumerate(stack.params):  # a matrix without a gradient (unused this step) stays put
                    if p.grad is not None:
                        self.update(p, p.grad, stack.momentum[i], None if stack.second is None else stack.second[i],
                                    lr, mom, wd, self.beta2, self.nesterov, self.cautious_wd, self.ortho_dtype)


@dataclass
class Stack:
    """Same-shape matrices stepped together, and their optimiser state stacked (K, rows, cols)."""

    params: list[torch.nn.Parameter]
    momentum: torch.Tensor
    second: torch.Tensor | None  # NorMuon's (K, rows, 1), or (K, 1, cols) for a wide matrix

    @classmethod
    def of(cls, params: list[torch.nn.Parameter], normuon: bool) -> Stack:
        k, (rows, cols), p = len(params), params[0].shape, params[0]
        second = None
        if normuon:
            shape = (k, rows, 1) if rows >= cols else (k, 1, cols)
            second = torch.zeros(shape, dtype=torch.float32, device=p.device)
        return cls(params, torch.zeros(k, rows, cols, dtype=p.dtype, device=p.device), second)


class AdamW(torch.optim.Optimizer):
    """AdamW whose lr and weight decay are 0-dim tensors, so changing them never retraces a graph."""

    def __init__(
        self, params, lr: torch.Tensor, betas: tuple[float, float], eps: float, weight_decay: torch.Tensor,
        decay: bool = True,
    ) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.decay = decay  # False: weight decay is 0 throughout, and its pass over every weight is skipped
        self.update = adamw_update  # compile() swaps in the compiled function
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].update(step=torch.zeros((), device=p.device), exp_avg=torch.zeros_like(p),
                                     exp_avg_sq=torch.zeros_like(p))

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                self.update(p, p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"], lr, b1, b2, eps, wd,
                            self.decay)


class Optimizers:
    """Muon + AdamW over a GPT's parameter groups, with their schedules applied from progress."""

    def __init__(self, groups: dict[str, list[torch.nn.Parameter]], model_dim: int, cfg: OptimConfig,
                 device: torch.device) -> None:
        self.cfg = cfg
        scale = (model_dim / 768) ** -0.5  # AdamW rates were tuned at width 768

        def scalar(value: float) -> torch.Tensor:
            return torch.tensor(value, dtype=torch.float32, device=device)

        self.base_lrs: list[tuple[torch.Tensor, float]] = []
        adam_groups = []
        betas = (cfg.adam_beta1, cfg.adam_beta2)
        # (lr, betas) per role; the residual scalars multiply the stream, compounding over layers: lr / 100.
        bases = {"embedding": (cfg.embedding_lr * scale, betas), "unembedding": (cfg.unembedding_lr * scale, betas),
                 "scalar": (cfg.scalar_lr, betas), "resid": (cfg.scalar_lr * 0.01, betas),
                 "x0": (cfg.scalar_lr, (cfg.x0_beta1, cfg.adam_beta2))}
        for name, (base, group_betas) in bases.items():
            if groups.get(name):
                lr = scalar(base)
                self.base_lrs.append((lr, base))
                adam_groups.append({"params": groups[name], "lr": lr, "betas": group_betas})
        self.adam_wd = scalar(cfg.adam_weight_decay)
        self.adamw = AdamW(adam_groups, lr=scalar(0.0), betas=(cfg.adam_beta1, cfg.adam_beta2), eps=1e-10,
                           weight_decay=self.adam_wd, decay=cfg.adam_weight_decay > 0)
        self.muon_lr = scalar(cfg.matrix_lr)
        self.base_lrs.append((self.muon_lr, cfg.matrix_lr))
        self.muon_momentum = scalar(cfg.muon_momentum_start)
        self.muon_wd = scalar(cfg.weight_decay)
        self.muon = Muon(groups["matrix"], lr=self.muon_lr, momentum=self.muon_momentum,
                         weight_decay=self.muon_wd, cautious_wd=cfg.cautious_wd,
                         beta2=scalar(cfg.muon_beta2) if cfg.normuon else None)

    def set_progress(self, progress: float) -> float:
        """Fill every scheduled scalar in place for this point of the run; returns the lr multiplier."""
        c = self.cfg
        mult = schedule.lr_multiplier(progress, c.warmup_ratio, c.warmdown_ratio, c.final_lr_frac)
        for tensor, base in self.base_lrs:
            tensor.fill_(base * mult)
        self.muon_momentum.fill_(schedule.muon_momentum(progress, c.muon_momentum_start, c.muon_momentum,
                                                        c.muon_momentum_warmup_ratio))
        self.muon_wd.fill_(c.weight_decay * schedule.weight_decay_multiplier(progress))
        return mult

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()

    def compile(self, backend: str = "inductor") -> None:
        """Compile each parameter's update, one graph per distinct shape, now (:meth:`warm_up`) rather than at the
        first step; the scheduled scalars are tensors, so a schedule's change never recompiles. A failure (no C++
        compiler for inductor, say) leaves the eager updates in place and raises."""
        import torch._dynamo

        limit = torch._dynamo.config.recompile_limit  # one graph per shape: more shapes than the default 8 may come
        torch._dynamo.config.recompile_limit = max(limit, sum(len(g["params"]) for o in (self.muon, self.adamw)
                                                              for g in o.param_groups))
        self.muon.update = compiled(muon_update, backend)
        self.adamw.update = compiled(adamw_update, backend)
        try:
            self.warm_up()
        except Exception:
            self.muon.update, self.adamw.update = muon_update, adamw_update
            raise

    @torch.no_grad()
    def warm_up(self) -> None:
        """Call each update once on copies of its parameters and state (zero gradients): every graph compiles here,
        and nothing the run holds changes."""
        muon = self.muon
        for group, stacks in zip(muon.param_groups, muon.stacks, strict=True):
            for stack in stacks:  # as Muon.step calls it: plain stacked tensors
                weights = torch.stack([p.detach() for p in stack.params])
                second = None if stack.second is None else stack.second.clone()
                muon.update(weights, torch.zeros_like(weights), stack.momentum.clone(), second, group["lr"],
                            group["momentum"], group["weight_decay"], muon.beta2, muon.nesterov, muon.cautious_wd,
                            muon.ortho_dtype)
        adamw = self.adamw
        for group in adamw.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                copy = torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
                state = {k: v.clone() for k, v in adamw.state[p].items()}
                adamw.update(copy, torch.zeros_like(p), state["exp_avg"], state["exp_avg_sq"], state["step"],
                             group["lr"], b1, b2, group["eps"], group["weight_decay"], adamw.decay)

    def zero_grad(self) -> None:
        self.muon.zero_grad(set_to_none=True)
        self.adamw.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

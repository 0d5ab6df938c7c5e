"""Does compressed training reach the accuracy of uncompressed training, with the same settings?

Trains one model per (compressor, optimizer, path, seed) on --ranks local Gloo processes (plain
``torch.multiprocessing``: no Spark, no MLflow; torch, numpy and scikit-learn only) and prints,
per compressor x optimizer x path, the final test accuracy (mean and std over the seeds), the
bytes each rank sent per step, and the steps it took to reach the uncompressed run's mean final
accuracy (``-``: never within --steps). Every compressor runs at its defaults with the
hyperparameters of the uncompressed run; ``powersgd-rR[-wS]`` is PowerSGD at rank R with S
uncompressed warm-up steps (``powersgd-r4-w10``: ``PowerSGD(rank=4, start_iter=10)``; the syntax of
every benchmark here, ``benchmarks/powersgd_names.py``), and ``efsign-bN`` is
``EFSign(bucket_size=N)`` (``efsign-whole``: one scale per tensor), and ``topk-noramp`` is
``ErrorFeedback(TopK(ramp_steps=0))`` (no sparsity warm-up), and ``topk-rR`` is
``ErrorFeedback(TopK(ratio=R))`` (``topk`` keeps 0.01, and 0.1 under Adam) and ``randomk-rR``
``ErrorFeedback(RandomK(ratio=R))``, to compare settings with the defaults;
``NAME-own`` (``efsign-own``, ``onebit-own``, ...) is NAME with ``compress_momentum=False``: each rank
compresses its own gradient, with no shared velocity (momentum SGD) or first moment (Adam);
``NAME-norescale`` is NAME with ``feedback.rescale_lr = False``: residuals kept as they are when the
lr moves; ``NAME-wN`` (``onebit-w60``) is NAME with ``feedback.warmup_steps = N``: its first N
reductions of each tensor uncompressed (as PowerSGD's ``-wS``). Two change the run as it goes:
``NAME-cN`` (``onebit-c30``) sends the last N steps uncompressed (NAME's residuals left unsent),
an uncompressed cool-down; ``NAME-dP`` (``efsign-d95``) is NAME with ``feedback.own_below = P / 100``:
the shared velocity while the lr is at its peak, each rank's own gradient once it has fallen below
P% of it (``OneBit``'s default is 95; ``onebit-d0`` keeps the shared velocity throughout). Under the
table, for every row that may switch, the step each seed switched at (``never`` where the lr stayed
above). ``--curves`` prints each row's mean test accuracy at every
``--eval-every`` steps: where along the run a gap opens.

Paths: ``hvd`` is ``spark_dl.horovod.DistributedOptimizer(opt, compression=c)``; ``ddp`` and
``ddp-overlap`` are ``DistributedDataParallel`` with ``make_ddp_hook(c, optimizer=opt)`` (with
``overlap=True`` for the second). Optimizers (lr scaled by the world size, as the linear
scaling rule has it): ``sgd`` (momentum 0.9), ``nesterov``, ``adam``, ``adamw``, ``recipe``
(``LargeBatchRecipe``: SGD with momentum, warmup, then cosine decay to 0) and ``recipe-step``
(the same warmup, then ``LargeBatchRecipe``'s default decay, Goyal et al.'s: the lr divided by 10 at
30/90, 60/90 and 80/90 of the run).

Models: ``digits`` (scikit-learn's 8x8 digits, a 64-64-10 MLP, 4,810 parameters) and ``teacher``
(a 512-1024-1024-10 MLP, 1.6M parameters, on Gaussian inputs labelled by a fixed random
teacher network: generated, nothing downloaded).

    python benchmarks/convergence.py                      # digits, 2 ranks, 3 seeds, 150 steps
    python benchmarks/convergence.py --model teacher --ranks 2 --threads 4 --seeds 3 --steps 300 \
        --paths ddp --optimizers nesterov,adam --lr-sgd 0.02 --compressors none,onebit,powersgd,qsgd \
        --time-limit 470                                  # about 15 s a run on a 16-core host

``--oracle-second-moment`` (a diagnostic, with ``adam``/``adamw`` only) gives Adam its second moment
from an uncompressed average of the ranks' gradients, computed beside the compressed reduction
(an extra backward and all-reduce a step), while its first moment takes the compressed one: how
much of a compressor's gap under Adam comes through the error Adam's second moment takes in.
Every row then uses that Adam, ``none`` included.

``--time-limit`` stops the runs there and prints the rows that finished. The settings, the machine,
the date and the git commit are printed above the table.
"""
from __future__ import annotations

import argparse
import math
import re
import sys
import time
from pathlib import Path
from queue import Empty

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import powersgd_names  # noqa: E402
from provenance import join_loopback, machine, start_ranks  # noqa: E402

import spark_dl.compression as C  # noqa: E402

COMPRESSORS = {
    "none": C.NoneCompressor, "fp16": C.FP16, "bf16": C.BF16, "qsgd": C.QSGD, "powersgd": C.PowerSGD,
    "qsgd-l2": lambda: C.QSGD(norm="l2"),  # the QSGD paper's scale, for comparison with the default
    "onebit": C.OneBit, "efsign": C.EFSign, "efsign-whole": lambda: C.EFSign(None),  # the paper's scale per tensor
    "topk": lambda: C.ErrorFeedback(C.TopK()),
    "topk-noramp": lambda: C.ErrorFeedback(C.TopK(ramp_steps=0)),  # no sparsity warm-up: 1% from the start
    "randomk": lambda: C.ErrorFeedback(C.RandomK()), "auto": C.Auto,
}


def _efsign_bucket(name: str) -> int | None:
    """N for ``efsign-bN`` (``EFSign(bucket_size=N)``, N >= 1), else None."""
    digits = name.removeprefix("efsign-b")
    return int(digits) if name.startswith("efsign-b") and digits.isdigit() and int(digits) >= 1 else None


# NAME-suffix: NAME with one switch of its training feedback off, and what NAME lacks where it has none
FEEDBACK_SWITCHES = {
    "-own": ("compress_momentum", "has no error feedback to share a momentum in"),
    "-norescale": ("rescale_lr", "has no residual to rescale"),
}


# NAME-cN, NAME-dP: what the training loop changes as the run goes (train())
IN_RUN = re.compile(r"(.+)-([cd])(\d+)")


def in_run(name: str) -> tuple[str, int, float | None]:
    """``(NAME, N, P / 100)`` for ``NAME-cN`` (N: steps sent uncompressed at the end) and ``NAME-dP``
    (P: the lr, in % of its peak, below which each rank compresses its own gradient), both for
    ``NAME-dP-cN``; ``(name, 0, None)`` for the others."""
    m = IN_RUN.fullmatch(name)
    if m is None or powersgd_names.settings(name) is not None:
        return name, 0, None
    base, cool, below = in_run(m.group(1))
    n = int(m.group(3))
    if m.group(2) == "d" and not 0 <= n <= 100:
        raise ValueError(f"{name}: -d<percent of the peak lr> takes 0 to 100")
    return base, n if m.group(2) == "c" else cool, n / 100 if m.group(2) == "d" else below


def compressor_named(name: str):
    """A fresh compressor for a --compressors name (PowerSGD's settings: benchmarks/powersgd_names.py;
    ``efsign-bN``: ``EFSign(bucket_size=N)``; ``NAME-own``: NAME with ``compress_momentum=False``, each
    rank compressing its own gradient: no shared velocity or first moment; ``NAME-norescale``: NAME
    with ``rescale_lr=False``; ``NAME-dP``: NAME with ``feedback.own_below = P / 100``; ``topk-rR``:
    ``ErrorFeedback(TopK(ratio=R))``, ``randomk-rR`` the same with ``RandomK``)."""
    base, cool, below = in_run(name)
    if cool or below is not None:
        c = compressor_named(base)
        if getattr(c, "feedback", None) is None:
            raise ValueError(f"{name}: {base} has no error feedback to " + ("cool down" if cool else "switch"))
        if below is not None:
            c.feedback.own_below = below
        return c
    warm = re.fullmatch(r"(.+)-w(\d+)", name)
    if warm and powersgd_names.settings(name) is None:  # NAME-wN; PowerSGD's -wS is its own start_iter
        c = compressor_named(warm.group(1))
        if getattr(c, "feedback", None) is None:
            raise ValueError(f"{name}: {warm.group(1)} has no error feedback to warm up")
        c.feedback.warmup_steps = int(warm.group(2))
        return c
    for suffix, (switch, missing) in FEEDBACK_SWITCHES.items():
        if name.endswith(suffix) and name != suffix:
            base = name.removesuffix(suffix)
            c = compressor_named(base)
            if getattr(c, "feedback", None) is None:
                raise ValueError(f"{name}: {base} {missing}")
            setattr(c.feedback, switch, False)
            return c
    at = powersgd_names.settings(name)
    if at is not None:
        return C.PowerSGD(**at)
    if _efsign_bucket(name) is not None:
        return C.EFSign(_efsign_bucket(name))
    if name.startswith("topk-r"):  # ErrorFeedback(TopK(ratio=R))
        return C.ErrorFeedback(C.TopK(ratio=float(name.removeprefix("topk-r"))))
    if name.startswith("randomk-r"):  # ErrorFeedback(RandomK(ratio=R))
        return C.ErrorFeedback(C.RandomK(ratio=float(name.removeprefix("randomk-r"))))
    return COMPRESSORS[name]()


def _constructs(name: str) -> bool:
    try:
        compressor_named(name)
        return True
    except (KeyError, ValueError):
        return False


OPTIMIZERS = ("sgd", "nesterov", "adam", "adamw", "recipe", "recipe-step")
PATHS = ("hvd", "ddp", "ddp-overlap")


def dataset(model: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_test, y_test), the same in every process."""
    if model == "digits":
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        x = torch.tensor(x, dtype=torch.float32) / 16.0
        y = torch.tensor(y, dtype=torch.long)
        perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
        x, y = x[perm], y[perm]
        cut = int(0.8 * len(y))
        return x[:cut], y[:cut], x[cut:], y[cut:]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(24000, 512, generator=gen)
    w1 = torch.randn(512, 64, generator=gen) / math.sqrt(512)
    w2 = torch.randn(64, 10, generator=gen) / math.sqrt(64)
    y = (torch.tanh(x @ w1) @ w2).argmax(1)
    return x[:20000], y[:20000], x[20000:], y[20000:]


def network(model: str) -> nn.Module:
    if model == "digits":
        return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


class OracleAdam(torch.optim.Optimizer):
    """Adam (AdamW with ``weight_decay``) at torch's defaults, whose second moment takes each
    parameter's ``oracle_grad`` (set before each step) where torch's takes ``grad``."""

    def __init__(self, params, lr: float, weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            (b1, b2), lr = group["betas"], group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                st["step"] += 1
                p.mul_(1 - lr * group["weight_decay"])
                st["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(p.oracle_grad, p.oracle_grad, value=1 - b2)
                denom = (st["exp_avg_sq"].sqrt() / math.sqrt(1 - b2 ** st["step"])).add_(group["eps"])
                p.addcdiv_(st["exp_avg"], denom, value=-lr / (1 - b1 ** st["step"]))


def optimizer(name: str, params, world: int, args):
    """(optimizer, the recipe whose scheduler drives it or None): the same settings whatever the compressor."""
    lr_sgd, lr_adam = args.lr_sgd, args.lr_adam
    if name in ("sgd", "nesterov"):
        return torch.optim.SGD(params, lr=lr_sgd * world, momentum=0.9, nesterov=name == "nesterov"), None
    if args.oracle_second_moment:
        return OracleAdam(params, lr=lr_adam * world, weight_decay=0.01 if name == "adamw" else 0.0), None
    if name == "adam":
        return torch.optim.Adam(params, lr=lr_adam * world), None
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr_adam * world, weight_decay=0.01), None
    from spark_dl.train import LargeBatchRecipe

    # warm up from the per-rank lr over the first fifth of the run, then cosine decay to 0 (recipe) or
    # the recipe's default, Goyal et al.'s steps at 30/90, 60/90 and 80/90 of the run (recipe-step)
    recipe = LargeBatchRecipe(lr_sgd, args.batch, per_rank_batch=args.batch, world_size=world, steps_per_epoch=10,
                              warmup_epochs=args.steps / 50, epochs=args.steps / 10,
                              decay="step" if name == "recipe-step" else "cosine")
    return torch.optim.SGD(params, lr=recipe.peak_lr, momentum=0.9), recipe


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def train(args, data, comp_name: str, opt_name: str, path: str,
          seed: int) -> tuple[float, list[float], float, list[str]]:
    """Final test accuracy, accuracy every --eval-every steps, bytes sent per step (this rank), and
    what ``auto`` picked per tensor at the end (empty for the others)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    xtr, ytr, xte, yte = data
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)  # the same initial weights on every rank
    net = network(args.model)
    compressor = compressor_named(comp_name)
    if path == "hvd":
        import spark_dl.horovod as hvd

        model = net
        opt, recipe = optimizer(opt_name, net.parameters(), world, args)
        opt = hvd.DistributedOptimizer(opt, named_parameters=net.named_parameters(), compression=compressor)
    else:
        model = DDP(net)
        opt, recipe = optimizer(opt_name, model.parameters(), world, args)
        state, hook = C.make_ddp_hook(compressor, overlap=path == "ddp-overlap", optimizer=opt)
        model.register_comm_hook(state, hook)
    sched = None if recipe is None else recipe.scheduler(opt)  # on the optimizer that steps
    _, cool, _ = in_run(comp_name)
    feedback = getattr(compressor, "feedback", None)
    # where the shared velocity gives way to each rank's own gradient in a decay (OneBit, NAME-dP): from which step
    watch = feedback is not None and feedback.own_below > 0 and feedback.compress_momentum
    switched = None
    shadow = None
    if args.oracle_second_moment:  # the model on the same memory, without the hooks that reduce its gradients
        shadow = network(args.model)
        for sp, p in zip(shadow.parameters(), net.parameters()):
            sp.data = p.data
    shard = torch.arange(rank, len(ytr), world)
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    curve, sent0 = [], C.stats.bytes_sent
    for step in range(args.steps):
        if cool and step >= args.steps - cool:  # every reduction from here on a warm-up one: uncompressed
            compressor.feedback.warmup_steps = sys.maxsize
        idx = shard[torch.randint(len(shard), (args.batch,), generator=gen)]
        if shadow is not None:  # this rank's gradients, averaged uncompressed, beside the run's own
            grads = torch.autograd.grad(nn.functional.cross_entropy(shadow(xtr[idx]), ytr[idx]),
                                        list(shadow.parameters()))
            for p, g in zip(net.parameters(), grads):
                dist.all_reduce(g)
                p.oracle_grad = g.div_(world)
        opt.zero_grad()
        nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
        opt.step()
        if watch and switched is None and not feedback.momentum and opt.param_groups[0].get("momentum"):
            switched = step  # this step's reductions compressed each rank's own gradient
        if sched is not None:
            sched.step()
        if (step + 1) % args.eval_every == 0:
            curve.append(accuracy(net, xte, yte))
    from spark_dl.compression.stats import label

    if isinstance(compressor, C.Auto):
        note = ", ".join(sorted({label(compressor.candidates[b.chosen]) for b in compressor.buckets.values()
                                 if b.phase == "chosen"})) or "nothing yet"
    elif watch:
        note = "never" if switched is None else f"from step {switched}"
    else:
        note = ""
    return accuracy(net, xte, yte), curve, (C.stats.bytes_sent - sent0) / args.steps, note


def rank_main(rank: int, args, port: int, queue) -> None:
    torch.set_num_threads(max(1, args.threads))
    join_loopback(rank, args.ranks, port)
    import warnings

    warnings.simplefilter("once")
    if "hvd" in args.paths:
        import spark_dl.horovod as hvd

        hvd.init()
    data = dataset(args.model)
    for comp in args.compressors:
        for opt in args.optimizers:
            for path in args.paths:
                for seed in range(args.seeds):
                    t0 = time.perf_counter()
                    result = train(args, data, comp, opt, path, seed)
                    if rank == 0:
                        queue.put((comp, opt, path, seed, *result, time.perf_counter() - t0))
    queue.put(None) if rank == 0 else None
    dist.barrier()
    dist.destroy_process_group()


def summarize(results: list[tuple], args) -> None:
    """Print the table: one row per compressor x optimizer x path."""
    runs: dict[tuple, list[tuple]] = {}
    picked: list[str] = []
    switched: dict[tuple, list[str]] = {}
    for comp, opt, path, seed, acc, curve, sent, note, _s in results:
        runs.setdefault((comp, opt, path), []).append((acc, curve, sent))
        if comp == "auto":
            picked.append(f"  {opt} {path} seed {seed}: {note}")
        elif note:
            switched.setdefault((comp, opt, path), []).append(note)
    width = max([11, *(len(r[0]) + 1 for r in results)])  # the compressor column fits its longest name
    ow = max([10, *(len(r[1]) + 1 for r in results)])  # the optimizer column its longest
    print(f"{'compressor':<{width}}{'optimizer':<{ow}}{'path':<12}{'accuracy':>16}{'vs none':>9}"
          f"{'bytes/step':>12}{'steps to none':>15}")
    for (comp, opt, path), rs in runs.items():
        accs = torch.tensor([r[0] for r in rs], dtype=torch.float64)
        std = float(accs.std()) if len(rs) > 1 else 0.0
        base = runs.get(("none", opt, path))
        target = float(torch.tensor([r[0] for r in base]).mean()) if base else float("nan")
        reach = []
        for _, curve, _ in rs:
            hit = next((i for i, a in enumerate(curve) if a >= target - 1e-9), None)
            reach.append(None if hit is None else (hit + 1) * args.eval_every)
        done = [r for r in reach if r is not None]
        steps = f"{sum(done) / len(done):.0f}" + ("" if len(done) == len(reach) else f" ({len(done)}/{len(reach)})") \
            if done else "-"
        gap = 100 * (float(accs.mean()) - target)
        print(f"{comp:<{width}}{opt:<{ow}}{path:<12}{float(accs.mean()):>9.3f} ±{std:.3f}{gap:>+8.1f}p"
              f"{sum(r[2] for r in rs) / len(rs):>12,.0f}{steps:>15}")
    if args.curves:
        print(f"mean test accuracy every {args.eval_every} steps:")
        for (comp, opt, path), rs in runs.items():
            curve = torch.tensor([r[1] for r in rs]).mean(0)
            print(f"{comp:<{width}}{opt:<{ow}}{path:<12}" + " ".join(f"{a:.3f}" for a in curve.tolist()))
    if picked:
        print("auto's picks at the end (over the tensors it decides):\n" + "\n".join(picked))
    if switched:
        print("each rank's own gradient through the decay, per seed:")
        for (comp, opt, path), notes in switched.items():
            print(f"  {comp} {opt} {path}: {'; '.join(notes)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("digits", "teacher"), default="digits")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=32, help="per rank")
    p.add_argument("--eval-every", type=int, default=0, help="test accuracy every this many steps (0: steps / 15)")
    p.add_argument("--lr-sgd", type=float, default=0.1, help="per rank (times --ranks)")
    p.add_argument("--lr-adam", type=float, default=0.002, help="per rank (times --ranks)")
    p.add_argument("--compressors", default=",".join(COMPRESSORS))
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--oracle-second-moment", action="store_true",
                   help="Adam's second moment from the uncompressed reduction (a diagnostic; adam/adamw only)")
    p.add_argument("--curves", action="store_true", help="print each row's mean accuracy every --eval-every steps")
    p.add_argument("--time-limit", type=float, default=0, help="seconds; stop there and print the runs done (0: none)")
    args = p.parse_args()
    for field, known in (("compressors", COMPRESSORS), ("optimizers", OPTIMIZERS), ("paths", PATHS)):
        values = [v for v in getattr(args, field).split(",") if v]
        bad = [v for v in values if not (_constructs(v) if field == "compressors" else v in known)]
        if bad:
            more = (f", {powersgd_names.SYNTAX}, efsign-b<bucket_size >= 1>, topk-r<ratio in (0, 1]>, "
                    "randomk-r<ratio in (0, 1]>, or any of those with error feedback and -own, -norescale, "
                    "-w<steps>, -c<last steps> or -d<percent of the peak lr>") \
                if field == "compressors" else ""
            p.error(f"--{field}: unknown {bad}; choose from {', '.join(known)}{more}")
        setattr(args, field, values)
    if args.oracle_second_moment and not set(args.optimizers) <= {"adam", "adamw"}:
        p.error("--oracle-second-moment: Adam's second moment only; use it with --optimizers adam,adamw")
    args.eval_every = args.eval_every or max(1, args.steps // 15)
    if "none" not in args.compressors:
        args.compressors.insert(0, "none")  # the reference every row is compared with
    print(f"convergence: model={args.model} ranks={args.ranks} seeds={args.seeds} steps={args.steps} "
          f"batch={args.batch}/rank lr_sgd={args.lr_sgd}x{args.ranks} lr_adam={args.lr_adam}x{args.ranks} "
          f"threads/rank={args.threads}" + (" second-moment=oracle" if args.oracle_second_moment else ""))
    print(f"machine: {machine()}")
    procs, queue = start_ranks(rank_main, args.ranks, args)
    results, t0 = [], time.perf_counter()
    while True:
        if args.time_limit and time.perf_counter() - t0 > args.time_limit:
            for proc in procs:
                proc.kill()
            print(f"stopped at --time-limit {args.time_limit:.0f} s: the rows below are the runs that finished")
            break
        try:
            item = queue.get(timeout=5)
        except Empty:
            if any(proc.exitcode for proc in procs):  # a rank died: its peers would wait for ever
                for proc in procs:
                    proc.kill()
                sys.exit("a rank failed (its traceback is above)")
            continue
        if item is None:
            break
        results.append(item)
        print(f"[{time.perf_counter() - t0:.0f} s] {' '.join(map(str, item[:4]))}: {item[4]:.3f}", file=sys.stderr)
    for proc in procs:
        proc.join()
        if proc.exitcode and not args.time_limit:
            sys.exit(f"a rank exited with {proc.exitcode}")
    summarize(results, args)
    print(f"{len(results)} runs in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()

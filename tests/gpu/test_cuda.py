"""CUDA and NCCL paths on a real GPU: compressors on device tensors, ``spark_dl.init`` choosing
NCCL and binding the rank's GPU, the Horovod optimizer's reducer thread and CUDA streams, the
compressed collectives and the DDP hook on NCCL, compression="auto" on CUDA gradients, GPU system
metrics, and the clear error when more ranks than GPUs would share one under NCCL.
"""
from __future__ import annotations

import pytest
import torch

import spark_dl.compression as C
from spark_dl import HorovodRunner
from spark_dl.errors import JobFailed

CUDA = torch.device("cuda", 0)


def _grad(n: int = 10_000, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("make", [C.FP16, C.BF16])
def test_casts_on_cuda_match_cpu_bit_for_bit(make):
    g = _grad()
    cpu = make().decompress(make().compress(g, key="g"))
    gpu = make().decompress(make().compress(g.to(CUDA), key="g"))
    assert gpu.device.type == "cuda"
    assert torch.equal(gpu.cpu(), cpu)


def test_onebit_on_cuda_matches_cpu():
    g = _grad(4096 + 7)
    cpu, gpu = C.OneBit(), C.OneBit()
    out_c = cpu.decompress(cpu.compress(g, key="g"))
    out_g = gpu.decompress(gpu.compress(g.to(CUDA), key="g"))
    assert torch.equal(torch.sign(out_g.cpu()), torch.sign(out_c))  # the same sign bits
    torch.testing.assert_close(out_g.cpu(), out_c, rtol=1e-5, atol=1e-6)  # means: reduction order only


def test_qsgd_on_cuda_is_unbiased():
    g = _grad(512).to(CUDA)
    q = C.QSGD(levels=3, bucket_size=128, seed=1)
    mean = torch.stack([q.decompress(q.compress(g, key="g")) for _ in range(2000)]).mean(0)
    # per element the variance is at most (norm/s)^2 / 4 per draw: 5 standard errors
    bound = 5 * g.view(-1, 128).norm(dim=1).repeat_interleave(128) / 3 / 2 / 2000 ** 0.5
    assert bool(((mean - g).abs() <= bound).all())


def test_topk_and_powersgd_on_cuda():
    g = _grad(10_000).to(CUDA)
    top = C.TopK(0.01, ramp_steps=0)  # k from the first call
    out = top.decompress(top.compress(g, key="g"))
    assert out.device.type == "cuda" and int((out != 0).sum()) == 100
    assert torch.equal(out.abs().topk(100).values, g.abs().topk(100).values)
    m = (torch.randn(256, 3, device=CUDA) @ torch.randn(3, 128, device=CUDA))  # rank 3
    p = C.PowerSGD(rank=4, start_iter=0)
    errs = [float((p.round(m, "m", lambda t: None)[0] - m).norm() / m.norm()) for _ in range(3)]
    assert errs[-1] < 1e-3, errs


def test_powersgd_bucket_on_cuda_matches_the_cpu():
    # a bucket of three low-rank weights (two of one shape: one batched group) and a bias,
    # factored weight by weight on the GPU; its bases are computed on the host
    gen = torch.Generator().manual_seed(3)
    w1 = torch.randn(20, 2, generator=gen) @ torch.randn(2, 15, generator=gen)
    w2 = torch.randn(8, 2, generator=gen) @ torch.randn(2, 27, generator=gen)
    w3 = torch.randn(20, 2, generator=gen) @ torch.randn(2, 15, generator=gen)
    flat = torch.cat([w1.reshape(-1), torch.randn(15, generator=gen), w2.reshape(-1), w3.reshape(-1)])
    shapes = [(20, 15), (15,), (8, 3, 3, 3), (20, 15)]
    outs = []
    for device in ("cpu", CUDA):
        p = C.PowerSGD(rank=2, start_iter=0)
        for _ in range(3):  # warm-started rounds: the Q kept on the device feeds the next round
            outs.append(p.round_layers(flat.to(device), shapes, "b", lambda t: (lambda: None)).cpu())
        assert all(q.device.type == torch.device(device).type for q in p.qs.values())
    for cpu, cuda in zip(outs[:3], outs[3:]):
        assert torch.allclose(cuda, flat, atol=1e-4)
        assert torch.allclose(cuda, cpu, atol=1e-4)


def gpu_rank_main(steps: int = 30):
    import spark_dl.horovod as hvd
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import spark_dl.compression as C
    from spark_dl.rank.tensors import comm_device

    hvd.init()
    out = {"backend": dist.get_backend(), "device": torch.cuda.current_device(),
           "comm": str(comm_device())}
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 64, generator=gen).cuda()
    y = (x @ torch.randn(64, 1, generator=gen).cuda()).squeeze(1) / 8  # unit variance

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                   torch.nn.ReLU(), torch.nn.Linear(256, 1)).cuda()

    # World size 1 averages to the identity: the Horovod optimizer must give exactly the plain
    # optimizer's trajectory, which it only does if the reducer thread waits for backward's stream.
    ref = model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(steps):
        ref_opt.zero_grad()
        F.mse_loss(ref(x).squeeze(1), y).backward()
        ref_opt.step()
    ref_params = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])

    losses = {}
    for name, comp in [("none", hvd.Compression.none), ("fp16", hvd.Compression.fp16),
                       ("qsgd", C.QSGD()), ("onebit", C.OneBit()), ("powersgd", C.PowerSGD(rank=2))]:
        m = model()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                       named_parameters=m.named_parameters(), compression=comp)
        side = torch.cuda.Stream()
        first = None
        for _ in range(steps):
            opt.zero_grad()
            with torch.cuda.stream(side):  # backward on a side stream, as AMP / user code may
                loss = F.mse_loss(m(x).squeeze(1), y)
                loss.backward()
            torch.cuda.current_stream().wait_stream(side)
            opt.step()
            first = float(loss) if first is None else first
        losses[name] = (first, float(F.mse_loss(m(x).squeeze(1), y)))
        if name == "none":
            got = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
            out["none_matches_plain_sgd"] = bool(torch.equal(got, ref_params))
    out["losses"] = losses

    # The NCCL calls the compressed collectives make (uint8 all_to_all and all_gather, float
    # all_reduce, async); at world size 1 spark_dl's own collectives skip them, so call them here.
    buf = torch.arange(64, dtype=torch.uint8, device="cuda")
    got = torch.empty_like(buf)
    dist.all_to_all_single(got, buf, async_op=True).wait()
    gathered = torch.empty_like(buf)
    dist.all_gather_into_tensor(gathered, buf, async_op=True).wait()
    f = torch.ones(8, device="cuda")
    dist.all_reduce(f)
    out["nccl_raw"] = bool(torch.equal(got, buf) and torch.equal(gathered, buf) and bool((f == 1).all()))

    # compressed collectives straight on NCCL, and the DDP hook
    g = torch.randn(10_001, device="cuda")
    out["allreduce"] = {k: float((C.allreduce(g, c, name="g") - g).abs().max())
                        for k, c in [("fp16", C.FP16()), ("onebit", C.OneBit()), ("qsgd", C.QSGD(seed=0)),
                                     ("topk", C.ErrorFeedback(C.TopK(0.5)))]}
    from torch.nn.parallel import DistributedDataParallel as DDP

    net = DDP(model(), device_ids=[torch.cuda.current_device()])
    state, hook = C.make_ddp_hook(C.FP16())
    net.register_comm_hook(state, hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(net(x).squeeze(1), y).backward()
        opt.step()
    out["ddp_loss"] = float(F.mse_loss(net(x).squeeze(1), y))
    return out


def test_rank_on_gpu_uses_nccl_and_the_horovod_optimizer_is_exact():
    out = HorovodRunner(np=-1).run(gpu_rank_main)
    assert out["backend"] == "nccl" and out["device"] == 0 and out["comm"] == "cuda:0"
    assert out["none_matches_plain_sgd"]
    assert out["nccl_raw"]
    for name, (first, last) in out["losses"].items():
        assert last < first, out["losses"]  # every compressor trains (plain SGD is slow here)
    assert out["allreduce"]["fp16"] < 1e-2
    assert out["allreduce"]["onebit"] < 10 and out["allreduce"]["qsgd"] < 10  # compressed, finite
    assert out["allreduce"]["topk"] < 10
    assert out["ddp_loss"] < out["losses"]["none"][0]


@pytest.mark.parametrize("use_nvml", [True, False])
def test_gpu_system_metrics_without_a_cuda_context(use_nvml):
    from spark_dl.tracking.system import gpu_sample

    got = gpu_sample(use_nvml=use_nvml)
    assert {"gpu0_utilization_percent", "gpu0_memory_used_gb", "gpu0_memory_percent"} <= set(got), got
    assert 0 <= got["gpu0_memory_percent"] <= 100


def two_ranks_default():
    import spark_dl

    spark_dl.init()


def test_more_ranks_than_gpus_under_nccl_is_a_clear_error():
    n = torch.cuda.device_count()
    with pytest.raises(JobFailed, match="NCCL needs one GPU per rank"):
        HorovodRunner(np=-(n + 1)).run(two_ranks_default)


def gloo_on_gpu_main():
    import spark_dl.horovod as hvd
    import torch
    import torch.nn.functional as F

    import spark_dl
    import spark_dl.compression as C

    spark_dl.init(backend="gloo")  # two ranks sharing one GPU: communicate through host memory
    hvd.init()
    torch.manual_seed(0)
    m = torch.nn.Linear(32, 1).cuda()
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   named_parameters=m.named_parameters(), compression=C.QSGD(seed=0))
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(hvd.rank())).cuda()
    for _ in range(5):
        opt.zero_grad()
        F.mse_loss(m(x), x[:, :1]).backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()]).cpu()
    # compressed collectives straight on CUDA tensors over Gloo (wire bytes staged through host)
    g = torch.randn(5000, 40, device="cuda", generator=torch.Generator("cuda").manual_seed(hvd.rank()))
    direct = {k: C.allreduce(g, c, name="d").cpu() for k, c in [
        ("fp16", C.FP16()), ("qsgd", C.QSGD(seed=0)), ("onebit", C.OneBit()),
        ("powersgd", C.PowerSGD(rank=2, start_iter=0))]}
    # the DDP hook on CUDA buckets, reduced in the hook and on its background thread
    from torch.nn.parallel import DistributedDataParallel as DDP
    for overlap in (False, True):
        torch.manual_seed(0)
        net = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).cuda(),
                  bucket_cap_mb=0.005)
        net.register_comm_hook(*C.make_ddp_hook(C.PowerSGD(rank=2, start_iter=1), overlap=overlap))
        sgd = torch.optim.SGD(net.parameters(), lr=0.05)
        for _ in range(5):
            sgd.zero_grad()
            F.mse_loss(net(x), x[:, :1]).backward()
            sgd.step()
        direct[f"ddp overlap={overlap}"] = torch.cat([p.detach().reshape(-1) for p in net.parameters()]).cpu()
    return flat, direct


def test_two_ranks_share_a_gpu_over_gloo_and_agree():
    (a, da), (b, db) = HorovodRunner(np=-2).run_all(gloo_on_gpu_main)
    assert torch.equal(a, b)
    for k in da:
        assert torch.equal(da[k], db[k]) and bool(da[k].isfinite().all()), k
        assert k.startswith("ddp") or da[k].shape == (5000, 40), k
    assert torch.equal(da["ddp overlap=True"], da["ddp overlap=False"])  # the same bits on a thread


def _nccl_rank():
    import os

    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl")  # the TorchDistributor idiom: the backend named, the env read
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    t = torch.ones(1, device="cuda") * (dist.get_rank() + 1)
    dist.all_reduce(t)
    out = {"sum": t.item(), "world": dist.get_world_size(), "cvd": os.environ.get("CUDA_VISIBLE_DEVICES")}
    dist.destroy_process_group()
    return out


def test_torch_distributor_local_mode_uses_one_process_per_driver_gpu(capfd):
    from spark_dl import TorchDistributor

    gpus = torch.cuda.device_count()
    out = TorchDistributor(num_processes=gpus + 1, local_mode=True, use_gpu=True).run(_nccl_rank)
    assert out["world"] == gpus and out["sum"] == gpus * (gpus + 1) / 2  # one process per GPU, NCCL
    assert f"training with {gpus} processes, one per GPU" in capfd.readouterr().err


def _prepared_on_gpu():
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import spark_dl

    model = spark_dl.prepare_model(torch.nn.Linear(3, 1))
    loader = spark_dl.prepare_data_loader(DataLoader(TensorDataset(torch.randn(8, 3), torch.randn(8, 1)), batch_size=4))
    devices = {str(t.device) for x, y in loader for t in (x, y)}
    return {"model": str(next(model.parameters()).device), "batches": sorted(devices),
            "device": str(spark_dl.get_device())}


def test_prepared_model_and_loader_live_on_the_ranks_gpu():
    out = HorovodRunner(np=-1).run(_prepared_on_gpu)
    assert out == {"model": "cuda:0", "batches": ["cuda:0"], "device": "cuda:0"}


def _resumes_a_gpu_checkpoint():
    import os

    import spark_dl

    spark_dl.init()
    state = spark_dl.load_checkpoint()
    if state is None:
        spark_dl.save_checkpoint({"w": torch.arange(4.0, device="cuda")})
        os._exit(9)  # restart: the next attempt loads it
    on_cpu = spark_dl.load_checkpoint(map_location="cpu")
    return str(state["w"].device), state["w"].tolist(), str(on_cpu["w"].device)


def test_a_checkpoint_of_cuda_tensors_comes_back_on_the_ranks_gpu():
    assert HorovodRunner(np=-1, max_restarts=1).run(_resumes_a_gpu_checkpoint) == (
        "cuda:0", [0.0, 1.0, 2.0, 3.0], "cpu")


def _forked_rank_on_gpu():
    import os

    import torch
    import torch.distributed as dist

    import spark_dl

    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
        forked = b"spark_dl.task.zygote" in f.read()
    spark_dl.init()  # NCCL: CUDA initialised in the forked rank, never in the zygote
    t = torch.full((4,), 2.0, device="cuda")
    dist.all_reduce(t)
    return {"forked": forked, "backend": dist.get_backend(), "sum": t.sum().item(),
            "device": str(spark_dl.get_device())}


def test_a_rank_forked_from_the_zygote_initialises_cuda_and_nccl():
    from spark_dl.task import zygote

    HorovodRunner(np=-1).run(_prepared_on_gpu)  # a run, so this process has a zygote
    assert zygote.wait_ready(60)
    out = HorovodRunner(np=-1).run(_forked_rank_on_gpu)
    assert out == {"forked": True, "backend": "nccl", "sum": 8.0, "device": "cuda:0"}


def auto_on_gpu_main(backend):
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import spark_dl
    import spark_dl.compression as C

    spark_dl.init(backend=backend)
    torch.manual_seed(0)
    net = DDP(nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)).cuda(),
              device_ids=[torch.cuda.current_device()])
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    state, hook = C.make_ddp_hook("auto", optimizer=opt)
    net.register_comm_hook(state, hook)
    g = torch.Generator(device="cuda").manual_seed(dist.get_rank())
    for _ in range(40):
        x = torch.randn(32, 64, device="cuda", generator=g)
        loss = nn.functional.cross_entropy(net(x), (x[:, 0] > 0).long())
        opt.zero_grad()
        loss.backward()
        opt.step()
        state.compressor.observe_loss(loss)
    params = torch.cat([p.detach().reshape(-1) for p in net.parameters()]).cpu()
    return {k: row["compressor"] for k, row in C.stats.choices.items()}, params


@pytest.mark.parametrize("backend, np", [("nccl", -1), ("gloo", -2)])
def test_compression_auto_on_cuda_gradients(backend, np):
    # NCCL: one rank (one GPU), the timed calls synchronize the device; Gloo: two ranks share it and
    # agree through a CPU all-reduce
    outs = HorovodRunner(np=np).run_all(auto_on_gpu_main, backend=backend)
    choices, params = outs[0]
    assert choices and all(c in ("NoneCompressor", "FP16", "PowerSGD", "OneBit") for c in choices.values())
    assert bool(params.isfinite().all())
    for other_choices, other_params in outs[1:]:
        assert other_choices == choices and torch.equal(other_params, params)
